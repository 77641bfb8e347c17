"""The batch-invariant target's products alone on a GPU: the fixed-order kernel (`fixed_linear`)
against the padded row blocks it replaces (`invariant.GPU_ROWS` rows a call, cuBLAS) and against
cuBLAS on the rows as they come (not batch-invariant: the floor to beat), on a target's weight
shapes, at 1, 16, 64 and 256 rows; and whether sampled rows get the same bits alone as among
the others.

    python scripts/gpu_linear.py [--hidden 1536 --intermediate 8960 --kv 256 --vocab 151936]
        [--rows 1,16,64,256] [--sweep] [--out FILE]

A split product's time with its parts added by a second kernel stands beside the kernel's
(`fixed_linear.LAST_ADDS`: by the last part to finish, one launch). `--sweep` times the kernel's
free settings instead (outputs per tile, programs wanted, warps,
stages: none of them changes a row's bits but the split, which `PROGRAMS` sets) on the q+k+v,
gate and down weights at 1 and 64 rows, for the next constants.

The defaults are the Qwen2.5-Coder-1.5B target's. Microseconds are device time per call,
replayed in a CUDA graph as the static path replays its passes (`triton.testing.
do_bench_cudagraph`, median), with the bandwidth that reading the weight once in that time
means. Without a GPU it runs the same steps on the CPU in Triton's interpreter (TRITON_INTERPRET=1,
`gpu-check.sh`'s dry run), timed roughly: a check of the script, not of the kernel.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
from torch.nn import functional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_attention import Report, timed  # noqa: E402 (scripts/, the script's own folder)

from pipeline.models import fixed_linear, invariant  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--kv", type=int, default=256, help="outputs of k (and of v)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--rows", default="1,16,64,256")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", type=Path)
    o = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    h = o.hidden
    shapes = {
        "q, o": (h, h),
        "k, v": (o.kv, h),
        "q+k+v": (h + 2 * o.kv, h),
        "gate, up": (o.intermediate, h),
        "gate+up": (2 * o.intermediate, h),
        "down": (h, o.intermediate),
        "output layer": (o.vocab, h),
    }
    rows = [int(r) for r in o.rows.split(",")]
    if o.sweep:
        picked = {k: shapes[k] for k in ("q+k+v", "gate, up", "down")}
        return sweep(picked, [rows[0], rows[-1]], device, dtype, Report(o.out))
    lines = Report(o.out)
    lines.append(
        f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU, Triton interpreter'}, torch "
        f"{torch.__version__}, {str(dtype).removeprefix('torch.')}; microseconds a call ("
        f"{'median, replayed in a graph' if device == 'cuda' else 'wall time, roughly'}) and GB/s of "
        f"weights; kernel: tiles of {fixed_linear.ROWS} rows x "
        f"{fixed_linear.BLOCK_N} outputs, inner steps of {fixed_linear.BLOCK_K}; blocks: "
        f"{invariant.GPU_ROWS} rows a call"
    )
    # the loader's check, which also makes the arrival counters before any graph is captured
    lines.append(f"the loader's check: {fixed_linear.works(device, dtype) or 'passed'}")
    torch.manual_seed(0)
    for name, (outputs, inner) in shapes.items():
        weight = torch.randn(outputs, inner, device=device, dtype=dtype) / inner**0.5
        bias = torch.randn(outputs, device=device, dtype=dtype) if name.startswith(("q", "k")) else None
        parts = fixed_linear.parts(outputs, inner)
        lines.append(f"{name} ({outputs} x {inner}, {parts[0]} part(s) of {parts[1]} steps):")
        gigabytes = weight.numel() * weight.element_size() / 1e9
        for n in rows:
            x = torch.randn(n, inner, device=device, dtype=dtype)
            kernel = partial(fixed_linear.product, x, weight, bias)
            blocks = partial(
                invariant._in_row_blocks(partial(functional.linear, weight=weight, bias=bias)), x
            )
            stock = partial(functional.linear, x, weight, bias)
            times = [timed(f, device, rep=100, graph=True) for f in (kernel, blocks, stock)]
            gap = (kernel().double() - fixed_linear.reference(x, weight, bias)).abs().max().item()
            # a split product's parts added by a second kernel instead of the last part (LAST_ADDS)
            second = partial(fixed_linear._multiply, x, weight, bias, last_adds=False)
            two = (
                f", second kernel adding {timed(second, device, rep=100, graph=True):7.1f}"
                if parts[0] > 1
                else ""
            )
            lines.append(
                f"  {n:>4} rows: kernel {times[0]:7.1f} ({gigabytes * 1e6 / times[0]:5.0f} GB/s){two}, "
                f"blocks {times[1]:7.1f} ({times[1] / times[0]:.2f}x), cuBLAS as they come {times[2]:7.1f} "
                f"({times[2] / times[0]:.2f}x); largest difference from float64 {gap:.2e}"
            )
        whole = fixed_linear.product(x, weight, bias)  # the widest call: sampled rows alone
        picks = sorted({0, len(x) // 3, len(x) - 1})
        same = sum(
            torch.equal(fixed_linear.product(x[r : r + 1], weight, bias), whole[r : r + 1]) for r in picks
        )
        lines.append(f"  bitwise alone as among {len(x)}: {same} of {len(picks)} rows")


def sweep(
    shapes: dict[str, tuple[int, int]], rows: list[int], device: str, dtype: torch.dtype, lines: Report
) -> None:
    """The kernel's microseconds a call under each setting (module constants, restored after),
    into `lines` (a `Report`)."""
    settings = [
        (block_n, programs, warps, stages)
        for block_n in (16, 32, 64)
        for programs in (128, 256, 512)
        for warps, stages in ((4, 4), (2, 4), (4, 3))
    ]
    lines.append("outputs a tile, programs wanted, warps, stages: microseconds a call (GB/s of weights)")
    kept = (fixed_linear.BLOCK_N, fixed_linear.PROGRAMS, fixed_linear.WARPS, fixed_linear.STAGES)
    torch.manual_seed(0)
    try:
        for name, (outputs, inner) in shapes.items():
            weight = torch.randn(outputs, inner, device=device, dtype=dtype) / inner**0.5
            gigabytes = weight.numel() * weight.element_size() / 1e9
            for n in rows:
                x = torch.randn(n, inner, device=device, dtype=dtype)
                cells = []
                for setting in settings:
                    fixed_linear.BLOCK_N, fixed_linear.PROGRAMS, fixed_linear.WARPS, fixed_linear.STAGES = (
                        setting
                    )
                    took = timed(partial(fixed_linear.product, x, weight, None), device, rep=30, graph=True)
                    cells.append((took, setting))
                cells.sort()
                best = ", ".join(
                    f"{s[0]}/{s[1]}/{s[2]}/{s[3]}: {t:.1f} ({gigabytes * 1e6 / t:.0f})" for t, s in cells[:4]
                )
                worst = cells[-1]
                lines.append(f"{name} ({outputs} x {inner}), {n} rows: best {best}; worst {worst[0]:.1f}")
    finally:
        fixed_linear.BLOCK_N, fixed_linear.PROGRAMS, fixed_linear.WARPS, fixed_linear.STAGES = kept


if __name__ == "__main__":
    main()
