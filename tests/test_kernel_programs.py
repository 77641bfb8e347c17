"""The static path's Triton kernels as a GPU would compile them, on a machine without one.

Their own tests (test_fixed_linear.py, test_fixed_attention.py) run them in Triton's
interpreter, which compiles nothing: neither whether they compile for a GPU nor which compiled
program a launch selects is seen there. Triton compiles a kernel apart for each specialization
of its arguments (an integer equal to 1 or divisible by 16, a pointer's alignment), and a
product's row count or an attention pass's width that chose the program would let a row's bits
follow its company. Here Triton's own launcher code (the binder a launch runs) computes each
launch's specialization for an H100/H200 (sm_90) from the arguments `launches` gives, and
Triton compiles it through ptxas, as the first launch on such a GPU would.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pipeline.models import arrivals, fixed_attention, fixed_linear

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)  # H100, H200
SHARED_MEMORY = 232_448  # bytes a program may use on sm_90 (227 KiB)
# The 1.5B target's products (q, k and v, o, gate and up, down: split in 4, 12, 1 and 5 parts)
WEIGHTS = [(1536, 1536, True), (256, 1536, True), (8960, 1536, False), (1536, 8960, False)]


def _compiled(kernel) -> JITFunction:
    """The kernel as a launch on a GPU compiles it: the tests import Triton interpreting."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


def _bind(kernel, arguments, settings):
    """What a launch of `kernel` on sm_90 computes before compiling: (the kernel, its bound
    arguments, the specialization that picks the compiled program, the launch options)."""
    kernel = _compiled(kernel)
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(HOPPER))
    bound, specialization, options = binder(*arguments, **settings)
    return kernel, bound, specialization, options


def _programs(planned) -> list[list]:
    """Each planned launch's specialization: equal lists, one compiled program."""
    return [_bind(kernel, arguments, settings)[2] for kernel, _, arguments, settings in planned]


def _compile(kernel, arguments, settings):
    kernel, bound, specialization, options = _bind(kernel, arguments, settings)
    options, signature, constexprs, attrs = kernel._pack_args(
        make_backend(HOPPER), settings, bound, specialization, options
    )
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=HOPPER, options=options.__dict__)


def _product_launches(rows: int, outputs: int, inner: int, bias: bool, dtype=torch.bfloat16, last_adds=True):
    """A product's launches as on a GPU, its parts added by the last part (`last_adds`) or by a
    second kernel."""
    x, weight = torch.empty((rows, inner), dtype=dtype), torch.empty((outputs, inner), dtype=dtype)
    count = fixed_linear.parts(outputs, inner)[0]
    out = torch.empty((rows, outputs), dtype=dtype)
    sums = out if count == 1 else torch.empty((count, rows, outputs))
    counts = torch.zeros(arrivals.SIZE, dtype=torch.int32) if last_adds else None
    b = torch.empty(outputs, dtype=dtype) if bias else None
    return fixed_linear.launches(x, weight, b, sums, out, counts, gpu=True)


def _attention_launches(slots, width, heads, kv_heads, dim, length, dtype=torch.bfloat16, last_merges=True):
    """Attention's launches as on a GPU, a tile's chunks merged by its last chunk (`last_merges`)
    or by a second kernel."""
    query = torch.empty((slots, heads, width, dim), dtype=dtype)
    key, value = (torch.empty((slots, kv_heads, length, dim), dtype=dtype) for _ in range(2))
    counts = torch.empty((slots, width), dtype=torch.int32)
    tiles = -(-width * (heads // kv_heads) // fixed_attention.ROWS)
    parts = (slots, kv_heads, tiles, -(-length // fixed_attention.CHUNK), fixed_attention.ROWS)
    sums = (torch.empty(parts), torch.empty(parts), torch.empty((*parts, dim)))
    out = torch.empty((slots, width, heads, dim), dtype=dtype)
    arrived = torch.zeros(arrivals.SIZE, dtype=torch.int32) if last_merges else None
    return fixed_attention.launches(query, key, value, counts, sums, out, arrived, dim**-0.5, gpu=True)


@pytest.mark.parametrize("last_adds", [True, False])
@pytest.mark.parametrize("outputs,inner,bias", WEIGHTS)
def test_a_product_compiles_one_program_whatever_its_rows(outputs, inner, bias, last_adds):
    alone = _programs(_product_launches(1, outputs, inner, bias, last_adds=last_adds))
    for rows in (2, 3, 15, 16, 17, 64, 200):
        assert _programs(_product_launches(rows, outputs, inner, bias, last_adds=last_adds)) == alone, rows


@pytest.mark.parametrize("last_merges", [True, False])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (9, 3, 64)])  # the 1.5B's, SmolLM2-135M's
def test_attention_compiles_one_program_whatever_the_pass(heads, kv_heads, dim, last_merges):
    """A query's program may follow neither the pass's width, nor its slots, nor the cache's
    length (which the slots' sizing sets: a speculative job reserves room for its drafts)."""
    alone = _programs(_attention_launches(1, 1, heads, kv_heads, dim, 449, last_merges=last_merges))
    for slots, width, length in [(1, 2, 449), (3, 8, 449), (64, 16, 449), (1, 1, 200), (2, 4, 4000)]:
        planned = _attention_launches(slots, width, heads, kv_heads, dim, length, last_merges=last_merges)
        assert _programs(planned) == alone


def _compile_all(dtype: torch.dtype) -> None:
    """Every kernel the static path launches (a split product and a whole one, attention at
    both head sizes), compiled for sm_90, each within a program's shared memory."""
    planned = _product_launches(16, 1536, 1536, True, dtype) + _product_launches(16, 8960, 1536, False, dtype)
    planned += _product_launches(16, 1536, 1536, True, dtype, last_adds=False)  # the second kernel adding
    for heads, kv_heads, dim in [(12, 2, 128), (9, 3, 64)]:
        planned += _attention_launches(2, 4, heads, kv_heads, dim, 449, dtype)
        planned += _attention_launches(2, 4, heads, kv_heads, dim, 449, dtype, last_merges=False)
    for kernel, _, arguments, settings in planned:
        compiled = _compile(kernel, arguments, settings)
        assert compiled.asm["cubin"], kernel
        assert compiled.metadata.shared <= SHARED_MEMORY, (kernel, compiled.metadata.shared)
        print(_compiled(kernel).fn.__name__, dtype, "shared memory", compiled.metadata.shared)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kernels_compile_for_an_h100(dtype):
    """Through Triton and ptxas, in a process of its own: these tests' Triton interprets, and
    its patched language does not compile."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, __file__, dtype], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    compiled = {line.split()[0] for line in run.stdout.splitlines() if "shared memory" in line}
    assert compiled == {"product", "combine", "attend_chunks"}, run.stdout


if __name__ == "__main__":
    _compile_all(getattr(torch, sys.argv[1]))
