"""Output quality against reference texts, for the report.

Speculative decoding cannot change *what* the target writes (greedy output is the target's own),
so these scores judge the target model and the prompt, not the engine. They answer the data
team's next-morning question: are the summaries or translations any good? Summaries are scored
with ROUGE (the usual summarization overlap measure); translations with chrF and BLEU from
sacrebleu, whose signatures make the numbers comparable with published ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class QualityScores:
    """Corpus scores (0-100), one per metric, and the per-row score of the headline metric."""

    metrics: dict[str, float]
    headline: str
    per_row: list[float] = field(default_factory=list)
    rows: int = 0
    signature: str = ""


def score(kind: str, hypotheses: list[str], references: list[str]) -> QualityScores:
    """ROUGE-1/2/L F1 for summaries; chrF and BLEU for translations and custom tasks."""
    pairs = [(h or "", r) for h, r in zip(hypotheses, references) if r and r.strip()]
    if not pairs:
        raise ValueError("no row has a non-empty reference")
    hyps, refs = [p[0] for p in pairs], [p[1] for p in pairs]
    if kind == "summarize":
        return _rouge(hyps, refs)
    return _chrf_bleu(hyps, refs)


def _rouge(hyps: list[str], refs: list[str]) -> QualityScores:
    from rouge_score import rouge_scorer

    names = ("rouge1", "rouge2", "rougeL")
    scorer = rouge_scorer.RougeScorer(list(names), use_stemmer=True)
    rows = [scorer.score(ref, hyp) for hyp, ref in zip(hyps, refs)]
    metrics = {
        name.replace("rouge", "ROUGE-"): 100 * sum(r[name].fmeasure for r in rows) / len(rows)
        for name in names
    }
    per_row = [100 * r["rougeL"].fmeasure for r in rows]
    return QualityScores(
        metrics, "ROUGE-L", per_row, len(rows), "rouge_score F1, Porter stemmer, mean over rows"
    )


def _chrf_bleu(hyps: list[str], refs: list[str]) -> QualityScores:
    import sacrebleu

    chrf = sacrebleu.metrics.CHRF()
    bleu = sacrebleu.metrics.BLEU()
    metrics = {
        "chrF": chrf.corpus_score(hyps, [refs]).score,
        "BLEU": bleu.corpus_score(hyps, [refs]).score,
    }
    per_row = [chrf.sentence_score(h, [r]).score for h, r in zip(hyps, refs)]
    signature = f"chrF {chrf.get_signature()}; BLEU {bleu.get_signature()}"
    return QualityScores(metrics, "chrF", per_row, len(hyps), signature)
