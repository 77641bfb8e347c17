"""Tiny but real transformers models for tests, saved to disk and loaded like users' models.

The target is a 2-layer Llama; the draft is the same network with perturbed weights so that it
agrees with the target often but not always, which exercises both the accept and the reject
paths of speculative decoding. Both share one byte-level BPE tokenizer trained here.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "Summaries copy phrases from their input documents, translations rarely do.",
    "Parquet shards are read from object storage and written back with statistics.",
    "Le renard brun saute par-dessus le chien paresseux.",
    "Data teams run batch jobs every night on a cluster of machines.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: any UTF-8 text encodes, so tests can feed arbitrary documents."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.15,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def build_tiny_pair(root: Path, noise: float = 0.08, seed: int = 0) -> tuple[Path, Path]:
    """Save a target and a perturbed-copy draft (plus tokenizer) under `root`; return both dirs."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    target = LlamaForCausalLM(tiny_config(len(tokenizer))).eval()
    draft = LlamaForCausalLM(tiny_config(len(tokenizer))).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn_like(p) * p.std().clamp_min(1e-3))
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / name
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]
