"""Shared fixtures. Everything here talks only to 127.0.0.1 and builds its own tiny models."""

from __future__ import annotations

import os

# Before Ray or botocore are imported anywhere: bind Ray to loopback and keep every library
# from calling home or probing cloud metadata endpoints (see shared/WORKPLACE.md).
os.environ.update(
    {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
        "AWS_EC2_METADATA_DISABLED": "true",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "http_proxy": "http://127.0.0.1:9",
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "https_proxy": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
)
# The static path's GPU attention kernel (Triton) runs on CPU tensors in Triton's interpreter,
# which must be chosen before Triton is first imported (tests/test_fixed_attention.py).
if os.environ.get("PIPELINE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from decode_case import DEVICE, MAX_NEW, TEXTS, reference  # noqa: E402
from tiny_models import build_tiny_pair  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

try:
    from s3_fixtures import *  # noqa: E402,F401,F403
except ImportError:  # pragma: no cover - the S3 fixtures module is optional while it is written
    pass


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory):
    """Directories of a tiny target, its perturbed draft and their shared tokenizer."""
    return build_tiny_pair(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def tiny_models(tiny_pair_dirs):
    """(target, draft, tokenizer) loaded once per session, float32, on `DEVICE` (CPU by default)."""
    target_dir, draft_dir = tiny_pair_dirs
    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().to(DEVICE)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval().to(DEVICE)
    return target, draft, AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="session")
def ray_local(s3_server):
    """One real local Ray for the session, started after the S3 env is set so workers inherit it."""
    import ray

    # "local": test_submit's `ray start --head` in another worker records its address in
    # /tmp/ray/ray_current_cluster, which a bare ray.init() would join
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def case(tiny_models):
    """Prompts, an EOS set that makes rows stop at different times, and reference outputs."""
    target, draft, tokenizer = tiny_models
    prompts = [tokenizer(t).input_ids for t in TEXTS]
    plain = [reference(target, p, MAX_NEW, [1]) for p in prompts]
    # Promote a token that several reference rows emit mid-way to an extra EOS, so rows
    # finish after different numbers of tokens, some early and some at max_new_tokens.
    counts: dict[int, int] = {}
    for row in plain:
        for t in set(row[3:-3]):
            counts[t] = counts.get(t, 0) + 1
    stopper = max(sorted(counts), key=lambda t: counts[t])
    eos = [1, stopper]
    refs = [reference(target, p, MAX_NEW, eos) for p in prompts]
    assert len({len(r) for r in refs}) > 2, "rows should stop at different times"
    return target, draft, tokenizer, prompts, eos, refs


@pytest.fixture(params=["python", "native"])
def search_path(request, monkeypatch):
    """The policy's search over a round's candidates in numpy, then, where `search.cpp` builds,
    in C++ (each test runs twice): "python" or "native"."""
    from pipeline.decode import search

    if request.param == "python":
        monkeypatch.setattr(search, "library", lambda: None)
    elif search.library() is None:
        pytest.skip("search.cpp cannot be built here")
    return request.param


@pytest.fixture(params=["python", "native"])
def lookups(request, monkeypatch):
    """The copying drafters' rounds in Python, then, where `lookups.cpp` builds, in C++ (each
    test runs twice): "python" or "native"."""
    from pipeline.decode import lookups as native_lookups

    if request.param == "python":
        monkeypatch.setattr(native_lookups, "library", lambda: None)
    elif native_lookups.library() is None:
        pytest.skip("lookups.cpp cannot be built here")
    return request.param
