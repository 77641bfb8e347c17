"""The static path's attention alone on a GPU: the fixed-order kernel (`fixed_attention`) against
the float64 attention it replaced, on a target's shapes, at batch 1 and 64 and widths 1, 4 and
16; and whether sampled queries get the same bits alone as in a batch-64 width-16 pass.

    python scripts/gpu_attention.py [--heads 12 --kv-heads 2 --dim 128 --contexts 400,4000]
        [--batches 1,64] [--chunks 64,128] [--out FILE]

The defaults are the Qwen2.5-Coder-1.5B target's attention. Seconds are device time per call,
medians of `triton.testing.do_bench_cudagraph`; the float64 attention is timed over a float64 cache, as
the static path kept it before the kernel (docs/gpu.md). Without a GPU it runs the same steps
on the CPU in Triton's interpreter (TRITON_INTERPRET=1, `gpu-check.sh`'s dry run), timed
roughly: a check of the script, not of the kernel. Beside the kernel's time stands its time with
a tile's chunks merged by a second kernel (`fixed_attention.LAST_MERGES` off), and with `--chunks`
the positions a program reads (`fixed_attention.CHUNK`, 256; a 400-token context at batch 1 makes
only 4 programs) set otherwise. Calls are replayed in a CUDA graph, as the static path replays
its passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.models import fixed_attention, invariant  # noqa: E402
from pipeline.models.architecture import ADDITIVE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument(
        "--contexts",
        default="400,4000",
        help="cached tokens before the pass's (a long one: the split's case)",
    )
    parser.add_argument("--batches", default="1,64")
    parser.add_argument(
        "--chunks",
        default="64,128",
        help="other positions a program reads (fixed_attention.CHUNK) to time the kernel with",
    )
    parser.add_argument("--out", type=Path)
    o = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    lines = Report(o.out)
    lines.append(
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU, Triton interpreter'}, torch "
        f"{torch.__version__}; {o.heads} heads, {o.kv_heads} "
        f"key/value heads of {o.dim}, bf16; microseconds a call (median)"
    )
    # the loader's check, which also makes the arrival counters the last chunk's merging counts on
    lines.append(f"the loader's check: {fixed_attention.works(device, torch.bfloat16, o.dim) or 'passed'}")
    batches = [int(b) for b in o.batches.split(",")]
    for context in (int(c) for c in o.contexts.split(",")):
        for slots in batches:
            lines.extend(compare(o, device, context, slots, check=slots == batches[-1]))


class Report(list):
    """A report's lines, each printed and added to `out` (where given) as it comes: a run cut by
    its step's time limit (`gpu-check.sh`) keeps what it measured."""

    def __init__(self, out: Path | None):
        super().__init__()
        self.out = out
        if out:
            out.write_text("")

    def append(self, line: str) -> None:
        super().append(line)
        print(line, flush=True)
        if self.out:
            with self.out.open("a") as file:
                file.write(line + "\n")

    def extend(self, lines) -> None:
        for line in lines:
            self.append(line)


def compare(o: argparse.Namespace, device: str, context: int, slots: int, check: bool) -> list[str]:
    """The two attentions timed on passes of widths 1, 4 and 16 over `context` cached tokens in
    each of `slots` slots; `check`: then sampled queries of the width-16 pass alone."""
    lines = []
    scale = o.dim**-0.5
    length = context + 16 + 16  # a slot: context, the widest pass, scratch
    keys, values = (
        torch.randn(slots, o.kv_heads, length, o.dim, device=device, dtype=torch.bfloat16) for _ in range(2)
    )
    wide_keys, wide_values = keys.double(), values.double()
    for width in (1, 4, 16):
        query = torch.randn(slots, width, o.heads, o.dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
        positions = context + torch.arange(width, device=device).repeat(slots, 1)
        visible = positions + 1
        seen = (torch.arange(length, device=device)[None, None, :] <= positions[:, :, None])[:, None]
        mask = seen
        if invariant.NAME in ADDITIVE:
            mask = torch.zeros(seen.shape, dtype=query.dtype, device=device)
            mask = mask.masked_fill(~seen, torch.finfo(query.dtype).min)

        fixed = partial(fixed_attention.attend, query, keys, values, visible, scale)
        float64 = partial(
            invariant.float64_attention, None, query, wide_keys, wide_values, mask, scaling=scale
        )
        # the chunks merged by a second kernel rather than by the last chunk (LAST_MERGES)
        second = partial(fixed_attention._attend, query, keys, values, visible, scale, last_merges=False)
        ours, theirs, two = (timed(f, device, graph=True) for f in (fixed, float64, second))
        gap = (fixed().double() - float64()[0].double()).abs().max().item()
        # other chunk sizes (positions a program reads: more programs for a short context at batch 1)
        by_chunk = []
        for chunk in (int(c) for c in o.chunks.split(",") if c):
            kept, fixed_attention.CHUNK = fixed_attention.CHUNK, chunk
            try:
                by_chunk.append(f"{chunk}: {timed(fixed, device, graph=True):.1f}")
            finally:
                fixed_attention.CHUNK = kept
        lines.append(
            f"context {context:>5} batch {slots:>2} width {width:>2}: fixed-order {ours:7.1f} (second "
            f"kernel merging {two:7.1f}; chunks of {', '.join(by_chunk) or '-'}), float64 {theirs:7.1f} "
            f"({theirs / ours:.2f}x), largest difference {gap:.2e}"
        )
    if check:  # the last pass (width 16): sampled queries alone, one token, one slot
        whole = fixed()
        picks = [(s, t) for s in sorted({0, slots // 3, slots - 1}) for t in (0, 7, 15)]
        same = 0
        for s, t in picks:
            alone = fixed_attention.attend(
                query[s : s + 1, :, t : t + 1],
                keys[s : s + 1],
                values[s : s + 1],
                visible[s : s + 1, t : t + 1],
                scale,
            )
            same += torch.equal(alone, whole[s : s + 1, t : t + 1])
        lines.append(f"bitwise alone as in the batch-{slots} width-16 pass: {same} of {len(picks)} queries")
    return lines


def timed(call, device: str, rep: int = 200, graph: bool = False) -> float:
    """Microseconds a call: device time on a GPU (median of do_bench, or with `graph` of replays
    of the call captured in a CUDA graph, as the static path replays its passes), wall time on a
    CPU."""
    if device == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graph:
            call()  # compiled outside the capture
            return 1000 * do_bench_cudagraph(call, rep=rep, return_mode="median")
        return 1000 * do_bench(call, warmup=25, rep=rep, return_mode="median")
    seconds = []
    for _ in range(3):
        began = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - began)
    return 1e6 * statistics.median(seconds)


if __name__ == "__main__":
    main()
