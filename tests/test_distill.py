"""`pipeline distill` on the tiny pair: a real run's outputs in, a tuned draft out that agrees with
the target more often on documents it never saw, installed as a pair that jobs, bench and
calibrate name like any other, with its provenance; bad runs and pairs are one-line errors.

The run is a real job's output (the shard processor a model actor runs, and the driver's
manifest), made in-process to keep Ray's start-up out of this file's time.
"""

from __future__ import annotations

import json
import re
import time
from itertools import permutations

import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from pipeline_helpers import job_dict, write_models_config
from tiny_models import CORPUS, build_tokenizer, tiny_config
from transformers import LlamaForCausalLM

from pipeline.cli import main
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.settings import EngineConfig
from pipeline.job.executor import JobResult, write_manifest
from pipeline.job.layout import name_shards
from pipeline.job.worker import build_processor
from pipeline.lab.distill import DISTILL_FILE, split_holdout
from pipeline.models.loading import eos_ids, load_pair, pad_id, resolve_pair
from pipeline.spec import spec_from_dict
from pipeline.storage import Storage, list_shards

SENTENCES = sorted(set(CORPUS))
# every ordered three of the tokenizer's sentences: 120 documents alike in kind, none the same
DOCUMENTS = [" ".join(three) for three in permutations(SENTENCES, 3)]


def make_run(tiny_pair_dirs, root, documents: list[str]) -> str:
    """A finished run of a summarize job over `documents` with the tiny pair; its output URL."""
    store = Storage(str(root / "in"))
    half = len(documents) // 2
    for k, part in enumerate((documents[:half], documents[half:])):
        ids = [f"doc{k}-{i}" for i in range(len(part))]
        store.write_parquet(f"part-{k}.parquet", pa.table({"id": ids, "text": part}))
    data = job_dict(tiny_pair_dirs, str(root / "in"), str(root / "out"), speedup_sample=0.01)
    data["input"]["keep_columns"] = []
    data["generation"]["max_new_tokens"] = 24
    # whole documents: prompts cut to their first sentence would repeat, and a held-out prompt
    # would be a trained one (`split_examples` then holds them out together)
    data["task"]["max_input_tokens"] = 192
    spec = spec_from_dict(data).with_absolute_paths()
    began = time.time()
    processor = build_processor(spec)
    shards = name_shards(list_shards(spec.input.url), spec.input.url)
    for url, name in shards:
        processor.process(url, name)
    out = Storage(spec.output.url)
    write_manifest(spec, out, JobResult(out.url, len(shards), 0), began)
    return spec.output.url


@pytest.fixture(scope="module")
def setting(tiny_pair_dirs, tmp_path_factory):
    """A model home of its own, a config naming the tiny pair (and one whose draft has another
    tokenizer), and a finished run of the tiny target."""
    root = tmp_path_factory.mktemp("distill")
    target_dir = tiny_pair_dirs[0]
    odd = root / "odd-draft"  # the tiny draft's shape, another tokenizer's vocabulary
    tokenizer = build_tokenizer(vocab_size=300)
    LlamaForCausalLM(tiny_config(len(tokenizer))).save_pretrained(odd)
    tokenizer.save_pretrained(odd)
    config = write_models_config(root / "cfg", tiny=tiny_pair_dirs, odd=(target_dir, odd))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPELINE_HOME", str(root / "home"))
        mp.setenv("PIPELINE_CONFIG_DIR", config)
        yield {"root": root, "run": make_run(tiny_pair_dirs, root / "run", DOCUMENTS)}


@pytest.fixture(scope="module")
def distilled(setting):
    """`pipeline distill` of the run into the pair `tiny-tuned`, with --json and --report, and an
    evaluation longer than the run's 24 tokens."""
    report = setting["root"] / "docs" / "distill-tiny.md"
    args = ["distill", setting["run"], "--pair", "tiny", "--out", "tiny-tuned", "--holdout", "0.1"]
    args += ["--epochs", "2", "--lora-rank", "8", "--lr", "3e-3", "--json", "--report", str(report)]
    args += ["--eval-max-new-tokens", "32"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["/venv/bin/pipeline", *args])
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), report


def test_distilling_evaluates_both_drafts_on_held_out_documents_losslessly(distilled):
    """The old and the new draft on documents neither trained on, every output target-only's.

    Whether the new draft is better there is what the evaluation measures, not what this test
    can promise: on the tiny pair, with held-out prompts no training prompt repeats, it is not
    (α 0.28 -> 0.23 at these settings). It rose by more than 0.1 only while prompts cut to a
    sentence repeated and the split let held-out documents share them with trained ones, the
    leak `split_examples` closes."""
    result, _ = distilled
    rows = {(r["drafter"], r["draft"]): r for r in result["evaluation"]["rows"]}
    assert set(rows) == {("none", "-")} | {
        (k, d) for k in ("draft_model", "auto") for d in ("before", "after")
    }
    before, after = rows[("draft_model", "before")], rows[("draft_model", "after")]
    assert result["evaluation"]["alpha_gain"]["draft_model"] == pytest.approx(
        after["alpha"] - before["alpha"]
    )
    agreement = result["top1_agreement"]
    assert 0 < agreement["before"] < 1 and 0 < agreement["after"] < 1
    assert agreement["after"] != agreement["before"]  # the new draft is another model
    for row in result["evaluation"]["rows"]:
        assert row["identical"], row  # every configuration decodes what target-only does
        if row["drafter"] != "none":
            assert row["speedup"] > 0 and row["predicted"] > 0
            assert all(0 <= a <= 1 for rates in row["acceptance_by_position"].values() for a in rates)
    assert len(after["acceptance_by_position"]["draft_model"]) == 4  # gamma_max of the run's settings
    loss = result["training"]["loss"]
    assert len(loss) == result["training"]["steps"] > 1 and loss[-1] < loss[0]


def test_the_evaluation_never_sees_a_training_document(distilled):
    result, _ = distilled
    data = result["data"]
    assert not set(data["train_ids"]) & set(data["holdout_ids"])
    assert len(data["train_ids"]) + len(data["holdout_ids"]) == data["documents"] == len(DOCUMENTS)
    assert result["evaluation"]["documents"] == data["holdout_ids"] and len(data["holdout_ids"]) == 12
    assert result["evaluation"]["max_new_tokens"] == 32  # --eval-max-new-tokens, not the run's 24
    # the split is by id alone: the same documents are held out again
    assert split_holdout(data["train_ids"] + data["holdout_ids"], 0.1) == (
        data["train_ids"],
        data["holdout_ids"],
    )


def test_provenance_is_written_beside_the_pair_and_in_the_report(distilled, setting):
    result, report = distilled
    pair_dir = setting["root"] / "home" / "models" / "pairs" / "tiny-tuned"
    written = json.loads((pair_dir / DISTILL_FILE).read_text())
    assert written == result
    assert written["source_run"]["url"] == Storage(setting["run"]).url
    assert written["source_run"]["run_id"] and written["source_run"]["task"]["kind"] == "summarize"
    assert written["source_pair"] == "tiny" and written["pair"] == "tiny-tuned"
    assert len(written["data"]["sha256"]) == 64 and written["data"]["completion_tokens"] > 0
    training = written["training"]
    assert training["mode"] == "lora" and training["lora_rank"] == 8 and training["lr"] == 3e-3
    assert training["stopped_by"] == "epochs" and training["epochs"] >= 2 and training["seconds"] > 0
    assert written["machine"]["git_commit"] and written["command"].startswith("pipeline distill")
    assert json.loads(report.with_suffix(".json").read_text()) == result
    text = report.read_text()
    assert "# Distill: tiny -> tiny-tuned" in text and "Loss (completion tokens' cross-entropy)" in text
    assert "draft_model  after" in text


def test_the_new_pair_loads_as_users_load_it_and_decodes_losslessly(distilled, tiny_pair_dirs):
    target, draft = resolve_pair("tiny-tuned")
    assert target.path == str(tiny_pair_dirs[0])  # the target is referenced, never copied
    assert draft.path.endswith("pairs/tiny-tuned/draft") and draft.revision.startswith("sha256:")
    pair = load_pair(target, draft, dtype="float32", device="cpu")
    tokenizer = pair.tokenizer
    prompts = [tokenizer(text).input_ids for text in DOCUMENTS[:4]]
    eos, pad = eos_ids(tokenizer, pair.target), pad_id(tokenizer, pair.target)
    engine = SpeculativeEngine(
        pair.target, pair.draft, eos_token_ids=eos, pad_token_id=pad, config=EngineConfig(adaptive=False)
    )
    speculative, stats = engine.generate(prompts, 16, drafter="draft_model")
    assert stats.drafted > 0
    for prompt, row in zip(prompts, speculative):
        plain = pair.target.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=pad
        )
        assert row.tokens == plain[0, len(prompt) :].tolist()
    listed = CliRunner().invoke(main, ["models", "list"])
    assert listed.exit_code == 0 and re.search(r"tiny-tuned +local +yes", listed.output)


def test_an_existing_pair_is_not_replaced_without_force(distilled, setting):
    args = ["distill", setting["run"], "--pair", "tiny", "--out", "tiny-tuned", "--steps", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2
    assert "already made on this machine" in result.output and "--force" in result.output
    assert "Traceback" not in result.output


def test_a_run_without_outputs_is_a_clear_error(setting, tmp_path):
    empty = CliRunner().invoke(main, ["distill", str(tmp_path / "nothing"), "--pair", "tiny", "--out", "x"])
    assert empty.exit_code == 2 and "no manifest.json under" in empty.output
    run = Storage(setting["run"])  # a run whose outputs are gone: its manifest alone
    bare = Storage(str(tmp_path / "bare"))
    bare.write_json("manifest.json", run.read_json("manifest.json"))
    result = CliRunner().invoke(main, ["distill", bare.url, "--pair", "tiny", "--out", "x"])
    assert result.exit_code == 2, result.output
    assert "no outputs under" in result.output and "Traceback" not in result.output


def test_a_draft_with_another_tokenizer_is_a_clear_error(setting):
    result = CliRunner().invoke(main, ["distill", setting["run"], "--pair", "odd", "--out", "x"])
    assert result.exit_code == 2, result.output
    assert "does not share the target model" in result.output and "Traceback" not in result.output


def test_distill_head_trains_a_head_on_the_run_and_writes_where_it_came_from(setting, tiny_models, tmp_path):
    from pipeline.decode.head import DraftHead

    out, report = tmp_path / "head", tmp_path / "docs" / "head.md"
    args = ["distill", setting["run"], "--head", "--out", str(out), "--epochs", "3", "--gamma", "3"]
    result = CliRunner().invoke(main, [*args, "--json", "--report", str(report)])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert json.loads((out / "distill.json").read_text()) == record
    data, training, held = record["data"], record["training"], record["held_out"]
    assert data["train"] + len(data["held_out"]) == data["documents"] == len(DOCUMENTS)
    assert training["steps"] == 3 * data["train"] and training["stopped_by"] == "epochs"
    assert training["chained_steps"] == 3  # the default: the first draft and the two after it
    first, last = training["loss"][: data["train"]], training["loss"][-data["train"] :]
    assert sum(last) < sum(first)  # it learned the run's completions
    assert held["gamma"] == 3 and held["before"]["rounds"] and held["after"]["rounds"]
    assert record["target"]["fingerprint"] == DraftHead.load(out, tiny_models[0]).fingerprint
    assert report.exists() and json.loads(report.with_suffix(".json").read_text()) == record
    assert "first draft accepted" in report.read_text()
    refused = CliRunner().invoke(main, args)  # the directory holds a head now
    assert refused.exit_code == 2 and "not empty" in refused.output
    # --prompts: the prompts' positions too, labelled with the target's own choices
    again = CliRunner().invoke(main, [*args, "--prompts", "--force", "--epochs", "1", "--json"])
    assert again.exit_code == 0, again.output
    whole = json.loads(again.stdout)
    assert whole["data"]["prompt_positions"] and not record["data"]["prompt_positions"]
    # the head proposes the tokens of the training completions alone, unless --head-vocab asks more
    assert whole["head"]["vocab_rows"] == record["head"]["vocab_rows"] < tiny_models[0].config.vocab_size
    wide = CliRunner().invoke(main, [*args, "--force", "--epochs", "1", "--json", "--head-vocab", "0"])
    assert wide.exit_code == 0, wide.output
    assert json.loads(wide.stdout)["head"]["vocab_rows"] == tiny_models[0].config.vocab_size
    chained = CliRunner().invoke(main, [*args, "--force", "--epochs", "1", "--json", "--chained-steps", "2"])
    assert chained.exit_code == 0, chained.output
    assert json.loads(chained.stdout)["training"]["chained_steps"] == 2


def test_distill_head_learns_from_several_runs_of_one_target(setting, tiny_pair_dirs, tmp_path):
    """A head needs more documents than one run holds: several runs of the same target are read
    together (each prompt built with its own run's task), a run named twice counts once, and a
    run of another target is a one-line error."""
    # none of them the first run's, even cut to a prompt's length: theirs never repeat a sentence
    other_docs = [" ".join((a, a, b, c)) for a, b, c in permutations(SENTENCES[:4], 3)]
    second = make_run(tiny_pair_dirs, tmp_path / "second", other_docs)
    base = ["--head", "--epochs", "1", "--gamma", "2", "--json"]
    twice = CliRunner().invoke(main, ["distill", second, second, *base, "--out", str(tmp_path / "h1")])
    assert twice.exit_code == 0, twice.output
    alone = json.loads(twice.stdout)["data"]["documents"]  # a row that wrote nothing teaches nothing
    assert 0 < alone <= len(other_docs)
    both = CliRunner().invoke(main, ["distill", setting["run"], second, *base, "--out", str(tmp_path / "h2")])
    assert both.exit_code == 0, both.output
    record = json.loads(both.stdout)
    # the second run's ids are the first's (doc0-0 ...), its documents are not: every one is kept
    assert record["data"]["documents"] == len(DOCUMENTS) + alone
    assert [r["url"] for r in record["source_runs"]] == [Storage(setting["run"]).url, Storage(second).url]
    draft_dir = tiny_pair_dirs[1]
    foreign = make_run((draft_dir, draft_dir), tmp_path / "foreign", other_docs[:4])
    refused = CliRunner().invoke(
        main, ["distill", setting["run"], foreign, *base, "--out", str(tmp_path / "h3")]
    )
    assert refused.exit_code == 2, refused.output
    assert "every run must share the target" in refused.output and "Traceback" not in refused.output
    model = CliRunner().invoke(main, ["distill", setting["run"], second, "--out", "x"])
    assert model.exit_code == 2 and "only with --head" in model.output


def test_distill_head_reads_back_the_features_it_kept(setting, tiny_pair_dirs, tmp_path):
    """--features-cache: a document's features are computed once; a distill again over the same
    run reads them all back and trains the same head, and a run added to it costs only its own."""
    cache = tmp_path / "features"
    base = ["--head", "--epochs", "1", "--gamma", "2", "--json", "--features-cache", str(cache)]
    first = CliRunner().invoke(main, ["distill", setting["run"], *base, "--out", str(tmp_path / "h1")])
    assert first.exit_code == 0, first.output
    computed = json.loads(first.stdout)
    documents = computed["data"]["documents"]
    # one file a distinct document (a document repeated within the runs is read back at once)
    distinct = len(list(cache.glob("*.pt")))
    assert 0 < distinct <= documents and not list(cache.glob("*.part"))
    assert computed["data"]["features_from_cache"] == documents - distinct
    report = tmp_path / "again.md"
    again = CliRunner().invoke(
        main, ["distill", setting["run"], *base, "--out", str(tmp_path / "h2"), "--report", str(report)]
    )
    assert again.exit_code == 0, again.output
    read = json.loads(again.stdout)
    assert read["data"]["features_from_cache"] == documents
    assert f"({documents} documents' features read from a cache)" in report.read_text()
    # the same features, so the same training and the same held-out replay
    assert read["training"]["loss"] == computed["training"]["loss"]
    assert read["held_out"] == computed["held_out"]
    # a sentence twice at the start: no prompt of the first run's, even cut short
    other_docs = [" ".join((a, a, b)) for a, b in permutations(SENTENCES[:4], 2)]
    second = make_run(tiny_pair_dirs, tmp_path / "second", other_docs)
    both = CliRunner().invoke(main, ["distill", setting["run"], second, *base, "--out", str(tmp_path / "h3")])
    assert both.exit_code == 0, both.output
    data = json.loads(both.stdout)["data"]
    added = len(list(cache.glob("*.pt"))) - distinct  # the second run's documents alone
    assert added > 0 and data["features_from_cache"] == data["documents"] - added


def test_a_text_under_two_ids_is_held_out_whole():
    """Examples sharing a prompt (one text under two names) or an id (one document in two runs)
    fall on one side of the split: else the evaluation reads a text trained on."""
    from pipeline.lab.distill import Example, split_examples

    examples = [Example(f"doc{i}", [i, i + 1], [7]) for i in range(40)]
    examples += [Example(f"twin{i}", [i, i + 1], [7]) for i in range(40)]  # doc{i}'s text again
    examples += [Example(f"doc{i}", [100 + i], [8]) for i in range(40)]  # doc{i} in a second run
    train, held = split_examples(examples, 0.2)
    assert held and len(train) + len(held) == len(examples)
    trained = {e.id for e in train} | {tuple(e.prompt) for e in train}
    assert not trained & ({e.id for e in held} | {tuple(e.prompt) for e in held})
    assert len(held) % 3 == 0  # whole documents: each its text, its twin and its second run
    assert split_examples(list(reversed(examples)), 0.2)[1] == sorted(held, key=examples.index)[::-1]


def test_a_text_and_its_next_version_are_held_out_whole():
    """Two completions mostly alike (the target's outputs for a text and its version a word
    apart) are one document; a preamble every completion shares does not make them alike."""
    from pipeline.lab.distill import Example, near_twins, split_examples

    preamble = list(range(1, 13))
    texts = [preamble + list(range(1000 * i, 1000 * i + 40)) for i in range(1, 41)]
    versions = [t[:30] + [7] + t[31:] for t in texts[:10]]  # one token changed mid-text
    examples = [Example(f"doc{i}", [i], t) for i, t in enumerate(texts)]
    examples += [Example(f"version{i}", [100 + i], t) for i, t in enumerate(versions)]
    assert sorted(near_twins([e.completion for e in examples])) == [(40 + i, i) for i in range(10)]
    assert near_twins([preamble + [i] * 3 for i in range(20)]) == []  # a shared preamble alone
    train, held = split_examples(examples, 0.2)
    assert len(held) == 8 + sum(e.id.startswith("doc") and int(e.id[3:]) < 10 for e in held)
    held_ids = {e.id for e in held}
    for i in range(10):
        assert (f"doc{i}" in held_ids) == (f"version{i}" in held_ids)
