"""Matrix products whose rows do not depend on how many rows share them, for the batch-invariant
target's decode and verify passes on a GPU (`linear_kernel`, two Triton kernels).

Why: cuBLAS picks its kernel by the number of rows, so the batch-invariant target ran every
Linear in padded blocks of `invariant.GPU_ROWS` (128) rows: one kernel shape for every pass.
A batch-1 decode pass then multiplies 128 rows where it has one. In bf16 on an H200 the 1.5B
shape's 128-row products are about as long in the tensor cores as in reading their weights
(≈ 0.45 TFLOP a pass), and in the profile of 2026-11-28 the gate, up and down products ran at
about 54% of the card's bandwidth, q, k and v as three latency-bound calls (docs/gpu.md).
Here a product runs in tiles of ROWS rows, each the same compiled program whatever the rows
are, and sums its inner dimension in blocks of BLOCK_K in a fixed split of parts (by the
weight's shape alone) added in order: a row's bits depend on that row and the weight only.
A batch-1 pass computes 16 rows, not 128; in a batch-64 pass the four row tiles of one weight
tile run side by side (the row tile is the grid's fastest axis), so that one of them should read
it from memory and the others from L2 (to be measured).

Prefills keep the row blocks (`invariant.PREFILL_ROWS`): a prompt token is always prefilled and
a generated one never, in target-only and speculative decoding alike, so the two need not round
alike. RMSNorm keeps its blocks too (a row reduction whose compiled kernel may follow its shape).
Whether the kernel is faster than the padded blocks is measured on a GPU (`scripts/gpu_linear.py`,
`calibrate --block-linears`): built on a CPU, not yet measured there.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from pipeline.models import arrivals, child_check, fixed_attention, streamed

log = logging.getLogger(__name__)

# Rows per tile: the products' fixed shape (the tensor cores' smallest).
ROWS = 16
# Outputs per tile: does not touch a row's sums; small, so that a batch-1 product has hundreds
# of programs (8,960 outputs: 280) to spread over a GPU's ~132 multiprocessors.
BLOCK_N = 32
# Inner-dimension step of a program: part of the order a row's sums take, so fixed.
BLOCK_K = 128
# Programs a product of one row tile should make at least, by splitting the inner dimension:
# a weight with few outputs (k and v: 256) would otherwise be read by a handful of programs.
PROGRAMS = 256
# Launch settings on a GPU: they change how fast a tile runs, never what it computes.
WARPS, STAGES = 4, 4
# A split product's parts added by the tile's last part to finish, in one launch, rather than by a
# second kernel (`linear_kernel`): the same bits either way, one launch fewer a split product (5
# of a 1.5B layer's 7).
LAST_ADDS = arrivals.LastAdds()


def parts(outputs: int, inner: int) -> tuple[int, int]:
    """(parts, blocks of BLOCK_K per part) the inner dimension of an `outputs` × `inner` weight
    is split in: from the weight's shape alone, never the rows', for it sets a row's order of
    sums."""
    blocks = -(-inner // BLOCK_K)
    wanted = max(1, min(blocks, round(PROGRAMS / -(-outputs // BLOCK_N))))
    per_part = -(-blocks // wanted)
    return -(-blocks // per_part), per_part


@torch.library.custom_op("pipeline::fixed_linear", mutates_args=())
def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias, x [rows, inner], weight [outputs, inner]: each row summed in one
    fixed order (module docstring). An op of its own so that a compiled pass calls it as it is."""
    return _multiply(x, weight, bias)


def _multiply(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, last_adds: bool = True
) -> torch.Tensor:
    """`product`, its parts added by the last part where `last_adds` and the device allows
    (`LAST_ADDS`), else by a second kernel (`works` compares the two)."""
    rows, inner = x.shape
    outputs = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    count = parts(outputs, inner)[0]
    out = torch.empty((rows, outputs), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    sums = out if count == 1 else torch.empty((count, rows, outputs), dtype=torch.float32, device=x.device)
    tiles = -(-rows // ROWS) * -(-outputs // BLOCK_N)
    counts = LAST_ADDS.counters(x.device, tiles) if count > 1 and last_adds else None
    for kernel, grid, arguments, settings in launches(x, weight, bias, sums, out, counts, x.is_cuda):
        kernel[grid](*arguments, **settings)
    return out


def launches(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sums: torch.Tensor,
    out: torch.Tensor,
    counts: torch.Tensor | None,
    gpu: bool,
) -> list[tuple]:
    """`product`'s kernel launches, (kernel, grid, arguments, settings) each, writing `out`
    through `sums` where the inner dimension is split ([parts, rows, outputs] float32, else `out`
    itself): its parts added by the last part of each tile, counted in `counts` (zeros, one a
    tile), or with `counts` None by a second kernel. `gpu`: as on a GPU (tensor cores, tuning),
    else as the interpreter runs them. One owner of the arguments, so that
    tests/test_kernel_programs.py can ask Triton which program each launch would compile for a
    GPU, on a machine without one."""
    from pipeline.models import linear_kernel

    rows, inner = x.shape
    outputs = weight.shape[0]
    count, per_part = parts(outputs, inner)
    grid = (-(-rows // ROWS), -(-outputs // BLOCK_N))
    # float32 products in float32 (not TF32), bf16 ones on the tensor cores; the interpreter's in float32
    exact = x.dtype == torch.float32 or not gpu
    tuning = {"num_warps": WARPS, "num_stages": STAGES} if gpu else {}
    spare = bias if bias is not None else x  # a pointer the kernel never reads
    split = (sums.stride(0) if count > 1 else 0, sums.stride(-2))
    last_adds = count > 1 and counts is not None
    product_arguments = (x, weight, spare, sums, out, counts if last_adds else x, rows, outputs, inner)
    product_arguments += (x.stride(0), weight.stride(0), *split, out.stride(0), per_part)
    settings = dict(ROWS=ROWS, BLOCK_N=BLOCK_N, PARTS=count, HAS_BIAS=bias is not None)
    kernel_settings = dict(settings, BLOCK_K=BLOCK_K, PRECISION="ieee" if exact else "tf32", UPCAST=not gpu)
    planned = [
        (
            linear_kernel.product,
            (*grid, count),
            product_arguments,
            dict(kernel_settings, LAST_ADDS=last_adds, **tuning),
        )
    ]
    if count > 1 and not last_adds:
        combine_arguments = (sums, spare, out, rows, outputs, *split, out.stride(0))
        planned.append((linear_kernel.combine, grid, combine_arguments, settings))
    return planned


@product.register_fake
def _(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`product` in float64: what `works` and the tests hold the kernel to."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@functools.cache
def works(device: str, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot multiply here (None: it can), from two small calls (one split, one
    not) checked against float64, against their own rows alone and, split, against the parts
    added by a second kernel. Why: a Triton or driver it does not compile on, or miscomputes on,
    must cost a job its speed only, never its outputs or its start: where only the last part's
    adding fails, the second kernel adds (`LAST_ADDS`); where more fails, the row blocks run.
    On a GPU the check runs first in a child process (`child_check`: a kernel that faults
    there would fail every later call of this one)."""
    reason = child_check.first_in_child(
        device,
        f"{__name__}:works_in_child",
        (device, str(dtype).removeprefix("torch.")),
        lambda: LAST_ADDS.checked(lambda: _check(device, dtype), device, f"fixed-order products ({dtype})"),
    )
    if reason is not None:
        log.warning("fixed-order products not used on %s (%s): %s; row blocks instead", device, dtype, reason)
    return reason


def works_in_child(device: str, dtype: str) -> str | None:
    """`works`, as `child_check` calls it in its child process (arguments as text)."""
    return works(device, getattr(torch, dtype))


def _check(device: str, dtype: torch.dtype) -> str | None:
    generator = torch.Generator().manual_seed(0)
    try:
        shapes = [(40, 3 * BLOCK_K - 84), (40, BLOCK_K - 28)]  # split in 3 parts, and not
        # on a GPU also as a model's weights compile (parts of several steps, rows a multiple of
        # 16 bytes): the 1.5B's q+k+v, 4 parts of 3 steps
        shapes += [(2048, 1536)] if device.startswith("cuda") else []
        for outputs, inner in shapes:
            x, weight, bias = (
                torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
                for shape in ((19, inner), (outputs, inner), (outputs,))
            )
            out = product(x, weight, bias)
            expected = reference(x, weight, bias)
            tolerance = 1e-4 if dtype == torch.float32 else 6e-2
            if not torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance):
                raise ValueError(
                    f"its result is {(out.double() - expected).abs().max().item():.2e} from float64's"
                )
            if not torch.equal(product(x[17:18], weight, bias), out[17:18]):
                raise ValueError("a row alone rounds otherwise than among 19")
            if not torch.equal(_multiply(x, weight, bias, last_adds=False), out):
                raise ValueError("the last part's adding differs from the second kernel's")
    except Exception as error:  # noqa: BLE001 - any failure of the kernel means: not here
        return f"{type(error).__name__}: {error}"[:300]
    return None


def serves(model: nn.Module) -> bool:
    """Can the kernel run `model`'s products: on a GPU (or interpreted, for the tests), where
    it `works`?"""
    parameter = next(model.parameters())
    interpreted = fixed_attention.CPU_INTERPRETED and parameter.device.type == "cpu"
    on_device = parameter.device.type == "cuda" or interpreted
    return on_device and fixed_attention.available() and works(str(parameter.device), parameter.dtype) is None


def apply(model: nn.Module) -> int:
    """Run the decode and verify passes' products of every plain Linear of `model` (and of its
    fused products) through the kernel, in place; prefills keep what they ran. Returns how
    many layers; idempotent."""
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or getattr(module, "_fused_into", None):
            continue  # a streamed or block layer, or a part of a fused product (`fusion`)
        if not getattr(module, "_fixed_linear", False):
            module.forward = _decoding_in_kernel(module, module.forward)
            module._fixed_linear = True
        count += 1
    model._fixed_linears = count > 0
    return count


def _decoding_in_kernel(linear: nn.Linear, forward):
    def run(x: torch.Tensor) -> torch.Tensor:
        if streamed.is_prefilling():
            return forward(x)
        out = product(x.reshape(-1, x.shape[-1]), linear.weight, linear.bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return run


def used(model: nn.Module) -> bool:
    """Do `model`'s decode and verify passes multiply in the kernel (`apply`)?"""
    return bool(getattr(model, "_fixed_linears", False))
