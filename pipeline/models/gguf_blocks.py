"""A GGUF model's own quantized blocks, kept beside its dense weights for the CPU kernel.

Why: the offline pair ships as GGUF (Q4_K and Q6_K blocks), and the install expands it to bf16
for transformers. A decode pass on a CPU reads every weight once, so reading the bf16 expansion
costs three times the bytes of the blocks it was made from; llama.cpp reads the blocks. Keeping
the blocks lets `streamed.BlockLinear` stream them and rebuild each weight in registers.

The install (`keep_blocks`) writes `blocks.safetensors` into a model directory: for every Linear
weight whose GGUF tensor has a type the kernel reads, the raw blocks as uint8 `[out_features,
bytes per row]`, its type in the file's metadata. Before keeping a tensor it checks that gguf's
own dequantization of the blocks, rounded to bf16, is bit for bit the installed bf16 weight: the
name mapping and the layout are then right. A tensor of another type, or one that fails the
check, stays dense (the report says which and why).

The block path's numbers are the blocks' own values in float32, not their bf16 rounding: see
`streamed_linear.cpp` and docs/cpu-kernels.md for what that changes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

FILE = "blocks.safetensors"
FORMAT = "1"
KERNEL_TYPES = ("Q4_K", "Q6_K")  # the GGUF block types `streamed_linear.cpp` reads
# GGUF tensors never used as a Linear weight (the input embeddings are a table lookup)
_NOT_LINEAR = ("token_embd",)


def _arch(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _name_map(reader, layers: int):
    import gguf

    arch_name = _arch(reader)
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {arch_name!r} is unknown to gguf {gguf.__version__}")
    return gguf.get_tensor_name_map(arch, layers)


def keep_blocks(gguf_path: Path, model_dir: Path) -> dict:
    """Write `model_dir/blocks.safetensors` from `gguf_path` (see the module docstring) and
    return a report: how many tensors of each type were kept, which stayed dense and why."""
    from gguf import GGUFReader, quants
    from safetensors import safe_open
    from safetensors.torch import save_file

    reader = GGUFReader(str(gguf_path))
    config = json.loads((model_dir / "config.json").read_text())
    names = _name_map(reader, int(config.get("num_hidden_layers", 0)))
    by_gguf = {t.name: t for t in reader.tensors}
    kept: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    report: dict = {"kept": {}, "dense": {}, "mismatch": []}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as dense:
        for key in dense.keys():
            if not key.endswith(".weight"):
                continue
            mapped = names.get_name(key.removesuffix(".weight"))
            tensor = by_gguf.get(f"{mapped}.weight") if mapped else None
            if tensor is None or mapped.startswith(_NOT_LINEAR) or len(tensor.shape) != 2:
                continue
            kind = tensor.tensor_type.name
            if kind not in KERNEL_TYPES:
                report["dense"][kind] = report["dense"].get(kind, 0) + 1
                continue
            weight = dense.get_tensor(key)
            rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists ne0 (the row) first
            blocks = np.ascontiguousarray(np.asarray(tensor.data).reshape(rows, -1))
            values = quants.dequantize(blocks, tensor.tensor_type).reshape(rows, cols)
            if tuple(weight.shape) != (rows, cols) or not torch.equal(
                torch.from_numpy(values).to(torch.bfloat16), weight.to(torch.bfloat16)
            ):
                report["mismatch"].append(key)
                continue
            kept[key] = torch.from_numpy(blocks.copy())
            types[key] = kind
            report["kept"][kind] = report["kept"].get(kind, 0) + 1
    if kept:
        save_file(kept, str(model_dir / FILE), metadata={"format": FORMAT, "types": json.dumps(types)})
    report["bytes"] = sum(t.numel() for t in kept.values())
    return report


def read_blocks(model_dir: str | Path) -> dict[str, tuple[str, torch.Tensor]] | None:
    """`{weight name: (GGUF type, uint8 blocks [rows, bytes per row])}` from a model directory's
    blocks file, or None where it has none (a model not installed from GGUF, or installed by a
    version that did not keep them)."""
    from safetensors import safe_open

    path = Path(model_dir) / FILE
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
        if meta.get("format") != FORMAT:
            log.warning("%s has format %r, not %r: not used", path, meta.get("format"), FORMAT)
            return None
        types = json.loads(meta.get("types", "{}"))
        return {key: (types[key], fh.get_tensor(key)) for key in fh.keys() if key in types}
