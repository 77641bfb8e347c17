"""Attention with one fixed order of summing per query, for the static path's decode and verify
passes on a GPU (`attention_kernel`, two Triton kernels).

Why: greedy speculative output must equal target-only output bit for bit, so a query's
attention may not depend on how many queries share its pass. The batch-invariant models' other
attention (`invariant.float64_attention`) gets there by summing in float64, which the rounding
back to the model's dtype absorbs; on an H200 it cost 14 of a layer's 87 microseconds in a
batch-1 pass of the 1.5B shape, and it keeps the whole cache in float64, four times a bf16
cache's bytes (docs/gpu.md). Here a query's keys are read in chunks of CHUNK positions from
position 0, each in blocks of BLOCK, and the chunks' sums merged in order, so its bits depend on
nothing else, in float32 over a cache in the model's own dtype (the keys a layer writes are
already rounded to it).

It needs a query's keys to be positions 0 .. visible-1 of its slot, as in the static path's
slots (a token's keys at its position, no holes, no padding before them). The dynamic path's
caches have holes and keep the float64 attention; so do prefills (hundreds of queries over the
same keys, where products pay; a prompt token is always prefilled, a generated one never, in
target-only and speculative decoding alike, so the two need not round alike).
"""

from __future__ import annotations

import functools
import logging

import torch

from pipeline.models import arrivals, child_check

log = logging.getLogger(__name__)

# Keys per step of a tile's program: part of the order a query's sums take, so fixed.
BLOCK = 64
# Query rows ((token, head) pairs sharing a key/value head) per program: the products' fixed shape.
ROWS = 16
# Positions per program: a slot's keys are split in chunks read at once (flash-decoding), each
# chunk's sums merged in order; fixed, as BLOCK is, for it shapes the order of a query's sums.
CHUNK = 256
# Tests set it: the static path attends with the kernel on a CPU too, run by Triton's interpreter.
CPU_INTERPRETED = False
# A tile's chunks merged by its last chunk to finish, in one launch, rather than by a second
# kernel (`attention_kernel`): the same bits either way, one launch fewer a layer.
LAST_MERGES = arrivals.LastAdds()


@functools.cache
def available() -> bool:
    """Is Triton installed (it comes with CUDA builds of torch)?"""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def serves(model: torch.nn.Module) -> bool:
    """Can the kernel attend for `model`'s static passes: on a GPU (or interpreted, for the
    tests), with a head size Triton can lay out (a power of two), where it `works`?"""
    parameter = next(model.parameters())
    config = model.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    on_device = parameter.device.type == "cuda" or (CPU_INTERPRETED and parameter.device.type == "cpu")
    fits = on_device and dim >= 16 and dim & (dim - 1) == 0 and available()
    return fits and works(str(parameter.device), parameter.dtype, dim) is None


@functools.cache
def works(device: str, dtype: torch.dtype, dim: int) -> str | None:
    """Why the kernel cannot attend here (None: it can), from one small call over two chunks
    checked against float64 attention and against the chunks merged by a second kernel. Why: a
    Triton or driver the kernel does not compile on, or miscomputes on, must cost a job its speed
    only, never its outputs or its start (a failed compile would fail every pass, graphs or not):
    where only the last chunk's merging fails, the second kernel merges (`LAST_MERGES`); where
    more fails, the float64 attention runs. On a GPU the check runs first in a child process
    (`child_check`: a kernel that faults there would fail every later call of this one)."""
    reason = child_check.first_in_child(
        device,
        f"{__name__}:works_in_child",
        (device, str(dtype).removeprefix("torch."), str(dim)),
        lambda: LAST_MERGES.checked(
            lambda: _check(device, dtype, dim), device, f"fixed-order attention ({dtype})"
        ),
    )
    if reason is not None:
        log.warning(
            "fixed-order attention kernel not used on %s (%s): %s; float64 attention instead",
            device,
            dtype,
            reason,
        )
    return reason


def works_in_child(device: str, dtype: str, dim: str) -> str | None:
    """`works`, as `child_check` calls it in its child process (arguments as text)."""
    return works(device, getattr(torch, dtype), int(dim))


def _check(device: str, dtype: torch.dtype, dim: int) -> str | None:
    generator = torch.Generator().manual_seed(0)
    query, key, value = (
        torch.randn(shape, generator=generator).to(device=device, dtype=dtype)
        for shape in ((2, 4, 3, dim), (2, 2, CHUNK + 44, dim), (2, 2, CHUNK + 44, dim))
    )
    visible = torch.tensor([[CHUNK + 10, CHUNK + 11, CHUNK + 12], [1, 2, CHUNK + 44]], device=device)
    try:
        out = attend(query, key, value, visible, dim**-0.5)
        if not torch.equal(_attend(query, key, value, visible, dim**-0.5, last_merges=False), out):
            return "the last chunk's merging differs from the second kernel's"
    except Exception as error:  # noqa: BLE001 - any failure of the kernel means: not here
        return f"{type(error).__name__}: {error}"[:300]
    expected = reference(query, key, value, visible, dim**-0.5)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    if torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance):
        return None
    return f"its result is {(out.double() - expected).abs().max().item():.2e} from float64 attention's"


def used(model: torch.nn.Module) -> bool:
    """Do `model`'s static passes attend with the kernel? For a batch-invariant model (others
    need no fixed order) where the kernel `serves`, unless the loader was told otherwise
    (`load_pair(float64_attention=True)`: the float64 attention, for an A/B)."""
    from pipeline.models import invariant

    if getattr(model.config, "_attn_implementation", None) != invariant.NAME:
        return False
    return not getattr(model, "_float64_attention", False) and serves(model)


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """`attend`'s result as the float64 attention it replaces computes it (`invariant.
    float64_attention`, in float64 throughout): what `works` and the tests hold the kernel to."""
    from pipeline.models import invariant

    hidden = torch.arange(key.shape[2], device=key.device)[None, None, None, :] >= visible[:, None, :, None]
    mask = torch.zeros(hidden.shape, dtype=torch.float64, device=key.device)
    mask = mask.masked_fill(hidden, torch.finfo(torch.float64).min)
    return invariant.float64_attention(
        None, query.double(), key.double(), value.double(), mask, scaling=scale
    )[0]


@torch.library.custom_op("pipeline::fixed_attention", mutates_args=())
def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale) v over each query's first `visible` keys of its slot.

    query [slots, heads, width, dim]; key, value [slots, kv heads, positions, dim] (heads share
    a kv head in groups); visible [slots, width] integers. Returns [slots, width, heads, dim] in
    the query's dtype, as `transformers`' attention functions do. An op of its own so that a
    compiled pass (`torch.compile`) calls it as it is."""
    return _attend(query, key, value, visible, scale)


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    last_merges: bool = True,
) -> torch.Tensor:
    """`attend`, a tile's chunks merged by its last chunk where `last_merges` and the device
    allows (`LAST_MERGES`), else by a second kernel (`works` compares the two)."""
    slots, heads, width, dim = query.shape
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    counts = visible.to(torch.int32).contiguous()
    tiles, chunks = _tiles(width, heads // key.shape[1]), _chunks(key.shape[2])
    parts = (slots, key.shape[1], tiles, chunks, ROWS)
    top, total = (torch.empty(parts, dtype=torch.float32, device=query.device) for _ in range(2))
    acc = torch.empty((*parts, dim), dtype=torch.float32, device=query.device)
    out = torch.empty((slots, width, heads, dim), dtype=query.dtype, device=query.device)
    arrived = LAST_MERGES.counters(query.device, slots * key.shape[1] * tiles) if last_merges else None
    chunk_sums = (top, total, acc)
    for kernel, grid, arguments, settings in launches(
        query, key, value, counts, chunk_sums, out, arrived, scale, query.is_cuda
    ):
        kernel[grid](*arguments, **settings)
    return out


def _tiles(width: int, group: int) -> int:
    return -(-width * group // ROWS)


def _chunks(length: int) -> int:
    return max(-(-length // CHUNK), 1)


def launches(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    counts: torch.Tensor,
    chunk_sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    out: torch.Tensor,
    arrived: torch.Tensor | None,
    scale: float,
    gpu: bool,
) -> list[tuple]:
    """`attend`'s kernel launches, (kernel, grid, arguments, settings) each: the chunks' sums
    (`chunk_sums`: running maximum, sum and weighted values) merged into `out` by each tile's
    last chunk, counted in `arrived` (zeros, one a tile), or with `arrived` None by a second
    kernel; `gpu`: as on a GPU (tensor cores), else as the interpreter runs them. One owner of
    the arguments, so that tests/test_kernel_programs.py can ask Triton which program each
    launch would compile for a GPU, on a machine without one."""
    from pipeline.models import attention_kernel

    slots, heads, width, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    tiles, chunks = _tiles(width, group), _chunks(length)
    shape = (kv_heads, tiles, chunks, group, width)
    # float32 products in float32 (not TF32), bf16 ones on the tensor cores; the interpreter's in float32
    exact = query.dtype == torch.float32 or not gpu
    last_merges = arrived is not None
    attend_arguments = (query, key, value, counts, *chunk_sums, out, arrived if last_merges else counts)
    attend_arguments += (
        *query.stride()[:3],
        *key.stride()[:3],
        *value.stride()[:3],
        *out.stride()[:3],
        *shape,
        scale,
    )
    precision = dict(PRECISION="ieee" if exact else "tf32", UPCAST=not gpu, LAST_MERGES=last_merges)
    settings = dict(DIM=dim, ROWS=ROWS, CHUNK=CHUNK)
    planned = [
        (
            attention_kernel.attend_chunks,
            (slots, kv_heads, tiles * chunks),
            attend_arguments,
            dict(settings, BLOCK=BLOCK, **precision),
        )
    ]
    if not last_merges:
        combine_arguments = (counts, *chunk_sums, out, *out.stride()[:3], *shape)
        planned.append((attention_kernel.combine, (slots, kv_heads, tiles), combine_arguments, settings))
    return planned


@attend.register_fake
def _(query, key, value, visible, scale):
    slots, heads, width, dim = query.shape
    return query.new_empty((slots, width, heads, dim))
