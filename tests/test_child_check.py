"""A kernel's check run first in a child process (pipeline.models.child_check): a check that
faults, crashes or hangs ends the child only, the verdict is kept on disk, and the loader's
checks of the fixed-order kernels consult it before launching a kernel themselves."""

from __future__ import annotations

import subprocess

import pytest
import torch

from pipeline.models import child_check, fixed_attention, fixed_linear


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path))  # where verdicts are kept
    monkeypatch.delenv(child_check.IN_CHILD, raising=False)
    return tmp_path


def test_a_check_that_passes_or_finds_the_kernel_wrong_answers_from_the_child_and_is_kept(monkeypatch):
    assert child_check.verdict("child_check_targets:passes", "cpu") is None
    wrong = child_check.verdict("child_check_targets:finds_it_wrong", "cpu")
    assert wrong == "its result is 1.0e+00 from float64's on cpu"

    def no_child(*args, **kwargs):
        raise AssertionError("a kept verdict starts no child")

    monkeypatch.setattr(subprocess, "run", no_child)
    assert child_check.verdict("child_check_targets:passes", "cpu") is None
    assert child_check.verdict("child_check_targets:finds_it_wrong", "cpu") == wrong


def test_a_check_that_faults_or_hangs_ends_the_child_only_and_is_asked_again(home):
    reason = child_check.verdict("child_check_targets:faults", "cpu")
    assert reason.startswith("its check ended a child process (signal 6)")
    assert "illegal memory access" in reason  # the child's last words
    reason = child_check.verdict("child_check_targets:hangs", "cpu", timeout=3)
    assert reason == "its check did not end within 3 s in a child process"
    # this process goes on using its device
    assert torch.ones(2).sum().item() == 2.0
    # no answer is kept: perhaps a passing shortage, the next process asks again
    assert not (home / "models" / "kernel-checks").exists()


def test_an_unwritable_cache_costs_the_keeping_only(home):
    (home / "models").mkdir()
    (home / "models" / "kernel-checks").write_text("a file where the directory would go")
    assert child_check.verdict("child_check_targets:passes", "cpu") is None


def test_verdicts_are_kept_apart_by_check_and_arguments():
    keys = {
        child_check._key("m:f", ("cuda:0", "bfloat16")),
        child_check._key("m:f", ("cuda:0", "float32")),
        child_check._key("m:g", ("cuda:0", "bfloat16")),
        child_check._key("m:f", ("cuda:0", "bfloat16", "64")),
    }
    assert len(keys) == 4


def test_the_current_gpu_named_cuda_or_cuda_0_keeps_one_verdict(monkeypatch):
    """The loader checks a kernel on its parameters' device ("cuda:0"), `gpu_linear.py` and
    `gpu_attention.py` on "cuda": one device, one verdict, one child's start and compile."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert child_check._key("m:f", ("cuda", "bfloat16")) == child_check._key("m:f", ("cuda:0", "bfloat16"))
    assert child_check._key("m:f", ("cuda:1", "bfloat16")) != child_check._key("m:f", ("cuda:0", "bfloat16"))


def test_only_a_gpu_outside_such_a_child_isolates(monkeypatch):
    assert child_check.isolates("cuda:0") and not child_check.isolates("cpu")
    monkeypatch.setenv(child_check.IN_CHILD, "1")
    assert not child_check.isolates("cuda:0")  # the child checks in-process, no grandchild


@pytest.mark.parametrize("kernel, args", [(fixed_linear, ()), (fixed_attention, (64,))])
def test_the_loaders_checks_launch_no_kernel_where_the_child_found_one_faulting(kernel, args, monkeypatch):
    """Isolated (as on a GPU): the child's fault is the check's answer, and the parent never
    launches the kernel; where the child found it right, the parent checks it again itself."""
    kernel.works.cache_clear()
    monkeypatch.setattr(child_check, "isolates", lambda device: True)
    launched = []
    monkeypatch.setattr(kernel, "_check", lambda *a: launched.append(a))
    faulted = (False, "its check ended a child process (signal 11): ")
    monkeypatch.setattr(child_check, "_run", lambda *a: faulted)
    assert kernel.works("cpu", torch.float32, *args).startswith("its check ended a child process")
    assert launched == []
    kernel.works.cache_clear()
    monkeypatch.setattr(child_check, "_run", lambda *a: (True, None))
    assert kernel.works("cpu", torch.float32, *args) is None and len(launched) == 1
    kernel.works.cache_clear()


@pytest.mark.parametrize("kernel, args", [(fixed_linear, ()), (fixed_attention, ("64",))])
def test_the_child_runs_the_loaders_own_check(kernel, args, monkeypatch):
    """The real check in a real child: Triton's interpreter on the CPU stands in for a GPU."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    target = f"{kernel.__name__}:works_in_child"
    assert child_check.verdict(target, "cpu", "float32", *args, timeout=240) is None
