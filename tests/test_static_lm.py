"""The static pass path (`StaticLM`): fixed slots written by position, fixed pass shapes (CUDA
graphs on a GPU, eager here) give bitwise the dynamic path's logits and the same outputs."""

from __future__ import annotations

import functools
import random
import time

import pytest
import torch
from decode_case import DEVICE, MAX_NEW, TEXTS

from pipeline.decode import static_lm
from pipeline.decode.batched_lm import BatchedLM
from pipeline.decode.engine import SpeculativeEngine
from pipeline.decode.sampling import RowLogits, greedy_choices
from pipeline.decode.settings import EngineConfig
from pipeline.decode.static_lm import StaticLM
from pipeline.decode.suffix import SuffixDrafter
from pipeline.models import invariant, loading
from pipeline.models.architecture import static_support
from pipeline.models.loading import ModelError, ModelRef, load_pair


def _load(dirs, static: bool):
    target, draft = (ModelRef(path=str(d)) for d in dirs)
    # batch-invariant numerics, as on a GPU by default: the contract the static path must keep
    kernels = {"batch_invariant": True, "static_passes": static}
    return load_pair(target, draft, dtype="float32", device=DEVICE, **kernels)


@pytest.fixture(scope="module")
def pairs(tiny_pair_dirs):
    """(static, dynamic): the tiny pair loaded twice, as a job loads it, one of each path."""
    return _load(tiny_pair_dirs, True), _load(tiny_pair_dirs, False)


def test_the_loader_marks_the_models_and_the_engine_picks_the_runner(pairs):
    static, dynamic = pairs
    assert static.static_passes and not dynamic.static_passes
    # served, never trained: no pass builds what a backward would need
    assert not any(p.requires_grad for p in static.target.parameters())
    assert static.manifest()["static_passes"] is True
    engine = SpeculativeEngine(static.target, static.draft, eos_token_ids=[1], pad_token_id=0)
    assert isinstance(engine.target, StaticLM) and isinstance(engine.draft.lm, StaticLM)
    engine = SpeculativeEngine(dynamic.target, dynamic.draft, eos_token_ids=[1], pad_token_id=0)
    assert type(engine.target) is BatchedLM


@pytest.fixture(scope="module")
def row_block_targets(tiny_pair_dirs):
    """The tiny target twice with a GPU's numerics (Linear and RMSNorm in fixed row blocks, their
    own block in prefills), here on whatever device the tests run on."""
    from transformers import AutoModelForCausalLM

    load = AutoModelForCausalLM.from_pretrained
    return [
        invariant.make_batch_invariant(load(tiny_pair_dirs[0], dtype=torch.float32).eval().to(DEVICE), True)
        for _ in range(2)
    ]


@pytest.mark.parametrize("numerics", ["as loaded", "row blocks"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("chunk, per_pass", [(static_lm.CHUNK, None), (7, None), (7, 3)])
def test_logits_equal_the_dynamic_paths_bit_for_bit(
    pairs, row_block_targets, numerics, batch, chunk, per_pass, monkeypatch
):
    """Ragged rounds as the engine runs them: prefills sharing a template (in pieces of `chunk`
    tokens, the last one padded, several to a pass or `per_pass`), verify passes of every graph width and
    wider, rejected drafts rolled back, rows leaving and joining."""
    monkeypatch.setattr(static_lm, "CHUNK", chunk)
    if per_pass:  # a row's pieces over several passes (both paths prefill in blocks of this size)
        monkeypatch.setattr(invariant, "PREFILL_ROWS", per_pass * chunk)
    static, dynamic = (p.target for p in pairs) if numerics == "as loaded" else row_block_targets
    rng = random.Random(batch)
    runners = [StaticLM(static, 0), BatchedLM(dynamic, 0)]
    # on a GPU the static path attends with the fixed-order kernel and the dynamic one in
    # float64: within float32's rounding of each other, each bitwise invariant on its own
    # (tests/test_fixed_attention.py)
    same = functools.partial(_same, exact=not runners[0].fixed_attention)
    template = [rng.randrange(3, 300) for _ in range(12)]
    seqs = [template + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 200))] for _ in range(batch)]
    for lm in runners:
        lm.reset(batch)
    same([lm.forward([list(s) for s in seqs], [1] * batch) for lm in runners])
    for s in seqs:  # the token the prefill chose
        s.append(rng.randrange(3, 300))
    for step in range(12):
        drafts = [[rng.randrange(3, 300) for _ in range(rng.choice([0, 1, 3, 7, 11, 15, 20]))] for _ in seqs]
        blocks = [lm.sync([s + d for s, d in zip(seqs, drafts)]) for lm in runners]
        assert blocks[0] == blocks[1]
        same([lm.forward(b, [len(d) + 1 for d in drafts]) for lm, b in zip(runners, blocks)])
        for s, d in zip(seqs, drafts):  # a few drafts accepted, then one token of the target's own
            s.extend(d[: rng.randrange(len(d) + 1)] + [rng.randrange(3, 300)])
        if step == 5 and batch > 1:  # a row leaves, two join (continuous batching)
            keep = list(range(1, len(seqs)))
            seqs = [seqs[i] for i in keep]
            for lm in runners:
                lm.sync(seqs)
                lm.select(keep)
            new = [template + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))] for _ in range(2)]
            same([lm.admit([list(s) for s in new], [1, 1]) for lm in runners])
            seqs += [s + [rng.randrange(3, 300)] for s in new]


def _same(pair: list[list[torch.Tensor]], exact: bool = True) -> None:
    ours, theirs = pair
    assert len(ours) == len(theirs)
    for row, (a, b) in enumerate(zip(ours, theirs)):
        same = torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-4)
        assert same, f"row {row}: {(a - b).abs().max()}"


@pytest.mark.parametrize("path", ["static", "dynamic"])
def test_a_pass_hands_its_logits_over_as_one_tensor_the_choices_are_read_from(pairs, path):
    """A verify pass's rows' logits are views of one tensor, and the batch's greedy choices
    (with their confidence) read from it equal those read row by row, as before (a runner that
    joined or rebuilt the rows would copy every logit again)."""
    model = pairs[0 if path == "static" else 1].target
    lm = StaticLM(model, 0) if path == "static" else BatchedLM(model, 0)
    rng = random.Random(7)
    seqs = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))] for _ in range(5)]
    lm.reset(len(seqs))
    lm.forward([list(s) for s in seqs], [1] * len(seqs))
    drafts = [[rng.randrange(3, 300) for _ in range(n)] for n in (0, 3, 1, 7, 2)]
    logits = lm.forward([[s[-1]] + d for s, d in zip(seqs, drafts)], [len(d) + 1 for d in drafts])
    assert isinstance(logits, RowLogits) and [len(x) for x in logits] == [len(d) + 1 for d in drafts]
    assert torch.equal(torch.cat(list(logits)), logits.whole)
    for confident in (False, True):
        assert greedy_choices(logits, confident) == greedy_choices(list(logits), confident)
    assert [len(x) for x in greedy_choices(logits, False)[0]] == [len(d) + 1 for d in drafts]


@pytest.mark.parametrize("drafter", ["none", "draft_model", "prompt_lookup", "suffix", "auto"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_outputs_equal_the_dynamic_paths_for_every_drafter(pairs, drafter, batch_size):
    outputs = []
    for loaded in pairs:
        tokenizer = loaded.tokenizer
        engine = SpeculativeEngine(
            loaded.target,
            loaded.draft,
            eos_token_ids=[1],
            pad_token_id=0,
            config=EngineConfig(drafter=drafter, gamma_max=6),
            decode_text=tokenizer.decode,
            encode_text=functools.partial(tokenizer.encode, add_special_tokens=False),
        )
        prompts = [tokenizer(t).input_ids for t in TEXTS]
        done, _ = engine.generate(prompts, MAX_NEW, batch_size=batch_size)
        outputs.append([o.tokens for o in done])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("drafter, adaptive", [("suffix", False), ("auto", True)])
def test_the_suffix_drafters_waiting_work_done_during_passes_keeps_outputs_the_targets(
    pairs, drafter, adaptive, monkeypatch
):
    """`prepare_in_passes` (on by default where a GPU runs the pass): the suffix drafter reflows
    rows and fills its corpus while each pass runs; on both paths every output stays the
    target's own, and the runner is left without the hook after the batch."""
    prepared, real = [], SuffixDrafter.prepare

    def prepare(self, until: float) -> None:
        prepared.append(until)
        real(self, until)

    monkeypatch.setattr(SuffixDrafter, "prepare", prepare)
    for loaded in pairs:
        tokenizer = loaded.tokenizer
        prompts = [tokenizer(t).input_ids for t in TEXTS]
        outputs = {}
        for name, prepare in ((drafter, True), ("none", None)):
            engine = SpeculativeEngine(
                loaded.target,
                loaded.draft,
                eos_token_ids=[1],
                pad_token_id=0,
                config=EngineConfig(drafter=name, gamma_max=6, adaptive=adaptive, prepare_in_passes=prepare),
                decode_text=tokenizer.decode,
                encode_text=functools.partial(tokenizer.encode, add_special_tokens=False),
            )
            for _ in range(2):  # the second call's rows find the first's outputs in the corpus
                done, _ = engine.generate(prompts, MAX_NEW, batch_size=3)
            outputs[name] = [o.tokens for o in done]
            assert engine.target.meanwhile is None
        assert outputs[drafter] == outputs["none"]
    assert prepared  # the hook ran (a CPU has no pass to wait for: on by request only)


def test_pass_widths_and_costs():
    assert [static_lm.width_of(n) for n in (1, 2, 3, 5, 9, 13, 16, 17)] == [1, 2, 4, 8, 12, 16, 16, None]


def test_a_model_the_path_cannot_run_is_refused_or_left_dynamic(tiny_pair_dirs, tmp_path):
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        logits_scaling=8.0,
    )
    granite = GraniteForCausalLM(config).eval()
    assert "granite" in static_support(granite)
    with pytest.raises(ValueError, match="static pass path"):
        StaticLM(granite, 0)
    assert type(static_lm.runner(granite, 0)) is BatchedLM
    granite._static_passes = True
    path = tmp_path / "granite"
    granite.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        source = tiny_pair_dirs[0] / name
        if source.exists():
            (path / name).write_bytes(source.read_bytes())
    with pytest.raises(ModelError, match="static_passes"):
        load_pair(ModelRef(path=str(path)), None, dtype="float32", device=DEVICE, static_passes=True)


def test_a_model_spread_over_several_gpus_stays_on_the_dynamic_path(pairs, monkeypatch):
    """With several GPUs visible the loader spreads a model over them (`device_map="auto"`);
    a static runner's slots live on one device, and its passes would fail at the first layer
    on another: such a model keeps the dynamic path (`_static_passes` says why)."""
    model = pairs[1].target
    assert static_support(model) is None
    monkeypatch.setattr(model, "hf_device_map", {"model.layers.0": 0, "model.layers.1": 1}, raising=False)
    assert "spread over 2 devices" in static_support(model)
    assert loading._static_passes(None, "cuda", model, None) is False  # a GPU's default: off, said why
    monkeypatch.setattr(model, "hf_device_map", {"model.layers.0": 0, "lm_head": 0}, raising=False)
    assert static_support(model) is None


def test_reserving_slots_captures_every_pass_shape_at_once(pairs, monkeypatch):
    """On a GPU, `reserve` (an engine before each batch) captures a graph for every width and
    the prefill piece, once: none is left to its first use inside a timed run."""
    model = pairs[0].target
    monkeypatch.setattr(model, "_static_store", None, raising=False)  # a fresh store, the fixture's kept
    asked = []

    def capture(lm, width):
        asked.append(width)
        return lm.graphs.setdefault(width, object())

    monkeypatch.setattr(StaticLM, "_capture", capture)
    lm = StaticLM(model, 0)
    lm.use_graphs = True
    lm.reserve(2, 40)
    assert asked == [*static_lm.WIDTHS, static_lm.PREFILL]
    lm.reserve(2, 30)
    assert len(asked) == len(static_lm.WIDTHS) + 1
    lm.reserve(2, 500)  # slots grown: the old graphs captured the old buffers
    assert len(asked) == 2 * (len(static_lm.WIDTHS) + 1)


def test_graphs_are_captured_without_autograd_whoever_asks(pairs, monkeypatch):
    """`reserve` runs outside the passes' `no_grad` (an engine before each batch, calibrate, the
    bench): a pass captured with autograd on would keep every activation its backward needs for
    the graph's life. On an H200 that was 26.7 GB for one slot of the 1.5B shape's graphs, and a
    batch of 64 ran out of the card's 140 GB."""
    model = pairs[0].target
    monkeypatch.setattr(model, "_static_store", None, raising=False)
    seen = []

    class Graph:  # what `_Graph` does on a GPU, less the CUDA graph: run the pass it captures
        def __init__(self, lm, width):
            hidden = lm._layers(*_scratch_pass(lm, width), None, 0)
            seen.append((torch.is_grad_enabled(), hidden.requires_grad))

    monkeypatch.setattr(static_lm, "_Graph", Graph)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    lm = StaticLM(model, 0)
    lm.use_graphs = True
    assert torch.is_grad_enabled()
    with monkeypatch.context() as m:  # a model loaded otherwise than by `load_pair`, which trains
        for p in model.parameters():
            m.setattr(p, "requires_grad", True)
        lm.reserve(2, 40)
    assert seen and set(seen) == {(False, False)}


class _ReplayedGraph:
    """What `_Graph` does on a GPU, less the CUDA graph: its replay runs the pass eagerly.
    Capturing takes `CAPTURE_SECONDS` (compiling and capturing take seconds on a GPU)."""

    CAPTURE_SECONDS = 0.3

    def __init__(self, lm, width):
        time.sleep(self.CAPTURE_SECONDS)
        self.lm = lm

    def replay(self, ids, positions, slots=None):
        return self.lm._layers(ids.to(self.lm.device), positions.to(self.lm.device), slots, 0)


def _on_a_fake_gpu(monkeypatch, graph) -> None:
    """A CPU runner that takes `graph` for `_Graph` and answers CUDA's memory calls."""
    monkeypatch.setattr(static_lm, "_Graph", graph)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_a_capture_after_grown_slots_is_not_counted_as_a_pass(pairs, monkeypatch):
    """Slots that grow mid-batch drop their graphs, and the next pass of each width captures
    (and compiles) again: seconds that are no pass's. Counted as one, they went into the cost
    model's measured passes (and a prefill's into its rate, which holds free places empty)."""
    model = pairs[0].target
    monkeypatch.setattr(model, "_static_store", None, raising=False)
    _on_a_fake_gpu(monkeypatch, _ReplayedGraph)
    lm = StaticLM(model, 0)
    lm.use_graphs = True
    lm.reserve(2, 40)
    lm.reset(2)
    prompts = [[5 + i % 50 for i in range(30)], [7 + i % 40 for i in range(20)]]
    lm.forward(prompts, [1, 1])  # a prefill
    lm.store.graphs.clear()  # as `grow` leaves them
    before = lm.forward_seconds
    lm.forward([[3], [4]], [1, 1])
    assert 1 in lm.graphs and lm.forward_seconds - before < _ReplayedGraph.CAPTURE_SECONDS
    lm.store.graphs.clear()
    lm.add_rows(1)
    before = lm.forward_seconds
    lm.admit([[9 + i % 30 for i in range(25)]], [1])
    assert static_lm.PREFILL in lm.graphs and lm.forward_seconds - before < _ReplayedGraph.CAPTURE_SECONDS


def test_a_capture_out_of_memory_is_raised_other_failures_run_eagerly_and_say_so(pairs, monkeypatch, caplog):
    """A graph that does not fit is the batch's size, which the shard answers by halving it
    (`_generate_fitting`): turned into eager passes for good, the model's every pass would have
    cost about ten times a replay's, at every batch size after. A kernel that cannot be
    captured runs eagerly, and the log says so."""
    model = pairs[0].target
    monkeypatch.setattr(model, "_static_store", None, raising=False)

    def no_room(lm, width):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    _on_a_fake_gpu(monkeypatch, no_room)
    lm = StaticLM(model, 0)
    lm.use_graphs = True
    with pytest.raises(torch.OutOfMemoryError):
        lm.reserve(2, 40)
    assert lm.graphs_off is None and lm.store.prefill_off is None

    def refused(lm, width):
        raise RuntimeError("operation not permitted when stream is capturing (injected)")

    monkeypatch.setattr(static_lm, "_Graph", refused)
    with caplog.at_level("WARNING", logger="pipeline.decode.static_lm"):
        lm.reserve(2, 40)
    assert "RuntimeError" in lm.graphs_off and "eagerly" in caplog.text


def test_a_batch_that_ran_out_of_memory_frees_its_slots_before_the_smaller_retry(pairs):
    """`switch` keeps each batch size's slots (and graphs) for its next batch; a batch retried at
    half its size after running out of memory (`_generate_fitting`) would then allocate the new
    slots beside the old ones. `release_memory` drops them all; decoding after it is unchanged."""
    static, _ = pairs
    engine = SpeculativeEngine(static.target, static.draft, eos_token_ids=[1], pad_token_id=0)
    prompts = [[5 + (i * k) % 50 for i in range(30)] for k in (1, 2, 3)]
    first, _ = engine.generate(prompts, MAX_NEW, drafter="draft_model", batch_size=3)
    engine.reserve(1, 30, MAX_NEW, "draft_model")
    stores = (engine.target.store, engine.draft.lm.store)
    assert all(3 in store.kept and store.capacity == 1 for store in stores)
    engine.release_memory()
    assert all(not store.kept and store.capacity == 0 and not store.keys for store in stores)
    again, _ = engine.generate(prompts, MAX_NEW, drafter="draft_model", batch_size=2)
    assert [r.tokens for r in again] == [r.tokens for r in first]


def _scratch_pass(lm: StaticLM, width) -> tuple[torch.Tensor, torch.Tensor]:
    width = static_lm.CHUNK if width == static_lm.PREFILL else width
    ids = torch.zeros(lm.capacity, width, dtype=torch.long, device=lm.device)
    positions = torch.arange(lm.total - width, lm.total, device=lm.device).repeat(lm.capacity, 1)
    return ids, positions


def test_a_warm_up_on_short_prompts_keeps_the_slots_the_real_batch_reserved(pairs):
    """The speedup sample warms a path with 2 tokens on a prompt's head: reserving the real batch's
    room first keeps the slots (and, on a GPU, the graphs captured over them) for the timed pair."""
    static, _ = pairs
    engine = SpeculativeEngine(static.target, static.draft, eos_token_ids=[1], pad_token_id=0)
    prompt = [5 + i % 50 for i in range(40)]
    engine.reserve(1, len(prompt), MAX_NEW, "draft_model")
    slots = (engine.target.keys[0], engine.draft.lm.keys[0])
    engine.generate([prompt[:16]], 2, drafter="draft_model", batch_size=1)
    engine.generate([prompt], MAX_NEW, drafter="draft_model", batch_size=1)
    assert engine.target.keys[0] is slots[0] and engine.draft.lm.keys[0] is slots[1]


def test_a_benchs_engines_share_each_models_slots_sized_once_per_batch(tiny_pair_dirs, monkeypatch):
    """The static cache is the model's: a bench's four engines (and their warm-ups on short
    prompts) pass through the same slots, sized once per batch size, so on a GPU each graph is
    captured once per model, not once per engine and again after the warm-up."""
    from pipeline.lab.bench import run_benchmark

    loaded = _load(tiny_pair_dirs, True)
    grown = []  # (store, rows) of every sizing
    grow = static_lm._Store.grow

    def counted(store, layers, shape, *args):
        grown.append((store, shape[0]))
        return grow(store, layers, shape, *args)

    monkeypatch.setattr(static_lm._Store, "grow", counted)
    result = run_benchmark(
        loaded,
        tasks=("summarize",),
        docs=3,
        batches=(1, 2),
        max_new_tokens=12,
        runs=2,
        drafters=("prompt_lookup", "draft_model", "auto"),
        hf=False,
        log=lambda line: None,
    )
    target, draft = loaded.target._static_store, loaded.draft._static_store
    sized = sorted((store is target, rows) for store, rows in grown)
    assert sized == [(False, 1), (False, 2), (True, 1), (True, 2)]
    assert all(store in (target, draft) for store, _ in grown)
    # without HF's rows there is nothing to compare with HF's target-only: reported as unknown
    assert all(r.identical and r.identical_to_hf is None for r in result.rows)


@pytest.mark.parametrize("fused", [False, True], ids=["as loaded", "fused projections"])
def test_compiled_passes_keep_every_drafters_output_equal_to_target_only(tiny_pair_dirs, fused):
    """Compiled layers (`torch.compile`, fused kernels) need not round as the eager ones do, so
    they are not held to the dynamic path's bits; they must keep the contract itself: with a
    GPU's numerics (row blocks), every drafter's greedy output is target-only's on the same
    compiled passes, and a verify pass never outgrows the graphs (a wider one would run eagerly).
    The same with q/k/v and gate/up one product each (`fusion`) in both models."""
    from transformers import AutoModelForCausalLM

    from pipeline.models import fusion

    load = AutoModelForCausalLM.from_pretrained
    target, draft = (load(d, dtype=torch.float32).eval().to(DEVICE) for d in tiny_pair_dirs)
    if fused:
        target, draft = fusion.fuse_projections(target), fusion.fuse_projections(draft)
    target = invariant.make_batch_invariant(target, True)
    for model in (target, draft):  # as load_pair(static_passes=True, compiled_passes=True) marks them
        model._static_passes = model._compiled_passes = True
    prompts = [list(range(5, 40)) * 2, list(range(60, 75)) * 3, list(range(7, 90, 3))]
    outputs = {}
    for drafter in ("none", "prompt_lookup", "draft_model"):
        config = EngineConfig(drafter=drafter, gamma_max=3)
        engine = SpeculativeEngine(target, draft, eos_token_ids=[1], pad_token_id=0, config=config)
        assert engine.target.compiled and engine.target.max_verify_tokens == static_lm.WIDTHS[-1]
        done, _ = engine.generate(prompts, 24, batch_size=2)
        outputs[drafter] = [o.tokens for o in done]
    assert outputs["prompt_lookup"] == outputs["none"] and outputs["draft_model"] == outputs["none"]
    assert engine.target.graph_record()["compiled"] and torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # every pass shape compiled, none left to run eagerly past dynamo's default of 8 a function
    assert torch._dynamo.config.cache_size_limit >= static_lm.COMPILED_SHAPES
    refs = [ModelRef(path=str(d)) for d in tiny_pair_dirs]
    with pytest.raises(ModelError, match="static pass path"):
        load_pair(*refs, dtype="float32", device=DEVICE, static_passes=False, compiled_passes=True)
    loaded = load_pair(*refs, dtype="float32", device=DEVICE, static_passes=True, compiled_passes=True)
    assert loaded.manifest()["compiled_passes"] and loaded.draft._compiled_passes


def test_passes_are_compiled_by_default_only_where_static_passes_run_on_a_gpu():
    from pipeline.models.loading import _compiled_passes

    assert _compiled_passes(None, "cuda", True) and _compiled_passes(None, "cuda:1", True)
    assert not _compiled_passes(None, "cuda", False)  # no static path (an architecture it lacks)
    assert not _compiled_passes(None, "cpu", True) and not _compiled_passes(False, "cuda", True)
    assert _compiled_passes(True, "cpu", True)
    with pytest.raises(ModelError, match="static pass path"):
        _compiled_passes(True, "cuda", False)


def _admissions(loaded, drafter: str, eos: list[int], batch_size: int) -> tuple[list[list[int]], list[int]]:
    """Every output, and how many rows each of the target's admissions prefilled."""
    tokenizer = loaded.tokenizer
    engine = SpeculativeEngine(
        loaded.target,
        loaded.draft,
        eos_token_ids=eos,
        pad_token_id=0,
        config=EngineConfig(drafter=drafter, gamma_max=4),
        decode_text=tokenizer.decode,
        encode_text=functools.partial(tokenizer.encode, add_special_tokens=False),
    )
    sizes, admit = [], engine.target.admit

    def counted(blocks, wanted):
        sizes.append(len(blocks))
        return admit(blocks, wanted)

    engine.target.admit = counted
    prompts = [tokenizer(t).input_ids for t in TEXTS * 2]
    done, _ = engine.generate(prompts, MAX_NEW, batch_size=batch_size)
    return [o.tokens for o in done], sizes


@pytest.mark.parametrize("drafter", ["none", "auto"])
def test_freed_places_wait_for_a_full_prefill_pass_where_a_pass_costs_the_same_whatever_it_holds(
    pairs, monkeypatch, drafter
):
    static, _ = pairs
    # an end-of-sequence token the target writes in the middle of some outputs, so that rows end
    # one at a time and their places free one by one
    outputs, _ = _admissions(static, "none", [1], 3)
    counts = torch.bincount(torch.tensor([t for out in outputs for t in out[2:-2]]))
    eos = [int(counts.argmax())]
    alone, sizes_alone = _admissions(static, drafter, eos, 3)
    assert sorted(set(map(len, alone))) != [MAX_NEW], "every row ran to the limit: no place freed alone"
    assert sizes_alone.count(1) > 2, "on a CPU each freed place is filled at once"

    # a prefill pass of 2 prompts' pieces, priced far above the rounds' seconds: places wait for
    # a pair of rows, except when nothing decodes or every waiting row has its place
    monkeypatch.setattr(StaticLM, "fixed_prefill", property(lambda self: 2))
    monkeypatch.setattr(
        "pipeline.decode.costs.CostModel.observe_prefill_pass",
        lambda self, passes, seconds: setattr(self, "prefill_pass", 1e9),
    )
    grouped, sizes = _admissions(static, drafter, eos, 3)
    assert grouped == alone, "a row's tokens do not depend on when it joins"
    assert sum(sizes) == len(alone) and len(sizes) < len(sizes_alone)
    assert all(n >= 2 for n in sizes[1:-1]), sizes

    # places left empty that have cost what a pass costs are filled
    monkeypatch.setattr(
        "pipeline.decode.costs.CostModel.observe_prefill_pass",
        lambda self, passes, seconds: setattr(self, "prefill_pass", 0.0),
    )
    again, sizes = _admissions(static, drafter, eos, 3)
    assert again == alone and sizes.count(1) > 2, sizes


@pytest.mark.parametrize("path", ["static", "dynamic"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_passes_back_to_back_choose_what_rounds_one_at_a_time_do(pairs, path, batch):
    """`greedy_steps` (each pass's choices fed to the next without the host, on a static
    runner) against the same passes made one `forward` at a time with the choices read between
    them: the same choices, and the cache they leave gives the pass after them the same logits
    bit for bit. Rows of unequal lengths in slots out of order (a row left before)."""
    model = pairs[0 if path == "static" else 1].target
    lm = StaticLM(model, 0) if path == "static" else BatchedLM(model, 0)
    seen = []
    for together in (False, True):
        rng = random.Random(batch)
        seqs = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 60))] for _ in range(batch + 1)]
        lm.reset(len(seqs))
        lm.forward([list(s) for s in seqs], [1] * len(seqs))
        seqs = seqs[1:]  # the first row leaves: the others' slots no longer start at 0
        lm.select(list(range(1, batch + 1)))
        firsts = [rng.randrange(3, 300) for _ in seqs]
        if together:
            chosen = lm.greedy_steps(firsts, 5)
        else:
            chosen, texts, tokens = [[] for _ in seqs], [list(s) for s in seqs], firsts
            for _ in range(5):
                texts = [text + [token] for text, token in zip(texts, tokens)]
                logits = lm.forward(lm.sync(texts), [1] * batch)
                tokens = torch.argmax(torch.cat(logits), dim=-1).tolist()
                for row, token in zip(chosen, tokens):
                    row.append(token)
        drafts = [[rng.randrange(3, 300) for _ in range(3)] for _ in seqs]
        whole = [s + [f] + c + d for s, f, c, d in zip(seqs, firsts, chosen, drafts)]
        blocks = lm.sync(whole)
        assert all(len(b) == 4 for b in blocks)  # the last choice and the drafts: the rest is cached
        seen.append((chosen, lm.forward(blocks, [4] * batch)))
    (one, one_logits), (together, together_logits) = seen
    assert together == one
    _same([together_logits, one_logits])


def test_prompt_lookup_as_tensor_ops_drafts_what_follows_the_latest_longest_match():
    history = torch.tensor(
        [
            [5, 6, 7, 8, 5, 6, 9, 5, 6, -1, -1],  # "5 6" last occurred before "9": drafts 9 5 6
            [1, 2, 3, 4, 2, 3, -1, -1, -1, -1, -1],  # "2 3" occurred at 1: 4 2 3 (3 of 3)
            [1, 2, 3, 9, 9, 9, 9, 9, 9, 2, 3],  # "9 2 3" nowhere, "2 3" at 1: 9 9 9
            [4, 4, 7, -1, -1, -1, -1, -1, -1, -1, -1],  # "7" never before: no draft
            [-1] * 11,  # a free slot
            [1, 2, 1, 2, -1, -1, -1, -1, -1, -1, -1],  # "1 2" at 0, followed by "1 2": 2 of 3
        ]
    )
    known = torch.tensor([9, 6, 11, 3, 0, 4])
    drafts, counts = static_lm._lookup(history, known, 3, (3, 2, 1))
    assert counts.tolist() == [3, 3, 3, 0, 0, 2]
    assert drafts.tolist() == [[9, 5, 6], [4, 2, 3], [9, 9, 9], [-1] * 3, [-1] * 3, [1, 2, -1]]


@pytest.mark.parametrize("drafts", ["looked up", "the target's own, some spoilt"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_lookup_rounds_on_the_device_keep_the_targets_greedy_tokens(pairs, batch, drafts, monkeypatch):
    """`lookup_steps` (drafts verified and accepted on the device, the passes back to back)
    against the target's greedy choices one token a pass: the same tokens, and a cache that gives
    the pass after them the one-at-a-time run's logits bit for bit. The tiny target seldom
    repeats itself, so its lookups are seldom accepted: the second case drafts the target's own
    next tokens instead, spoilt at one place in some rounds and absent in others, so that whole,
    partial and no acceptance all run. Rows in slots out of order (a row left before)."""
    lm = StaticLM(pairs[0].target, 0)  # one runner at a time: the model owns the slots
    rng = random.Random(batch)
    seqs = [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 40))] for _ in range(batch + 1)]
    firsts = [rng.randrange(3, 300) for _ in range(batch)]
    gamma, steps = 3, 6

    def start() -> None:
        lm.reset(len(seqs))
        lm.forward([list(s) for s in seqs], [1] * len(seqs))
        lm.select(list(range(1, batch + 1)))  # the first row leaves: the others' slots move on

    def one_at_a_time(count: int) -> list[list[int]]:
        texts, out = [s + [f] for s, f in zip(seqs[1:], firsts)], [[] for _ in firsts]
        for _ in range(count):
            logits = lm.forward(lm.sync(texts), [1] * batch)
            for text, row, token in zip(texts, out, torch.argmax(torch.cat(logits), dim=-1).tolist()):
                row.append(token)
                text.append(token)
        return out

    def after(made: list[list[int]]) -> list[torch.Tensor]:
        """A pass after: each row's tokens but its last, then another token and two more."""
        whole = [s + [f] + m[:-1] + [3 + (m[-1] + 1) % 297, 7, 8] for s, f, m in zip(seqs[1:], firsts, made)]
        blocks = lm.sync(whole)
        assert all(len(b) == 3 for b in blocks)
        return lm.forward(blocks, [3] * batch)

    start()
    reference = one_at_a_time(steps * (gamma + 1))
    if drafts != "looked up":
        texts = {lm.row_slots[r]: s + [f] + o for r, (s, f, o) in enumerate(zip(seqs[1:], firsts, reference))}
        calls = []

        def own(history, known, gamma, ngrams):
            calls.append(None)
            drafted = torch.full((len(known), gamma), -1, dtype=torch.long)
            for slot, text in texts.items():
                k, turn = int(known[slot]), (len(calls) + slot) % 3
                if turn:  # turn 0: no drafts
                    drafted[slot] = torch.tensor(text[k : k + gamma])
                    drafted[slot, 1] += turn == 1  # spoilt at the second draft
            return drafted, (drafted >= 0).sum(dim=1)

        monkeypatch.setattr(static_lm, "_lookup", own)
    start()
    budgets = [steps * (gamma + 1)] * batch if drafts == "looked up" else [10 + 4 * r for r in range(batch)]
    made, rounds = lm.lookup_steps(firsts, gamma, steps, budgets)
    assert made == [row[: len(m)] for row, m in zip(reference, made)]
    assert all(len(m) == sum(a + 1 for _, a in r) for m, r in zip(made, rounds))
    # a row runs every round, or stops once it has its budget (its slot's room), at most a pass past it
    assert all(len(r) == steps or b <= len(m) < b + gamma + 1 for m, r, b in zip(made, rounds, budgets))
    if drafts != "looked up":
        assert {a for r in rounds for _, a in r} == {0, 1, gamma}
    looped = after(made)
    start()
    one_at_a_time(max(map(len, made)))
    _same([looped, after(made)])


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_an_engine_with_lookup_rounds_on_the_device_gives_target_only_outputs(pairs, batch_size):
    """`EngineConfig.lookup_steps`: greedy prompt lookup runs its rounds on the device, back to
    back: the outputs of target-only decoding, rows ending at an EOS or their limit inside the
    rounds, more rows than places (rows admitted between loops), in fewer engine rounds; the
    counters add up as the host rounds' do. Other drafters keep their host rounds."""
    loaded = pairs[0]
    prompts = [loaded.tokenizer(t).input_ids for t in TEXTS] * 2

    def run(drafter, steps, eos, gamma_max=6):
        config = EngineConfig(drafter=drafter, gamma_max=gamma_max, lookup_steps=steps)
        engine = SpeculativeEngine(
            loaded.target, loaded.draft, eos_token_ids=eos, pad_token_id=0, config=config
        )
        rounds, round_, loops, loop_ = [0], engine._round, [0], engine._lookup_rounds
        engine._round = lambda batch: (rounds.__setitem__(0, rounds[0] + 1), round_(batch))
        engine._lookup_rounds = lambda batch, n: (loops.__setitem__(0, loops[0] + 1), loop_(batch, n))[1]
        done, stats = engine.generate(prompts, MAX_NEW, batch_size=batch_size)
        assert stats.new_tokens == sum(len(o.tokens) for o in done)
        assert stats.accepted <= stats.drafted and stats.row_passes >= stats.new_tokens - stats.accepted
        return [(o.tokens, o.finish_reason) for o in done], rounds[0], loops[0], stats

    early = run("none", 1, [1])[0][0][0][2]  # the first row's third token ends rows now
    target_only = run("none", 1, [early])[0]
    hosted, host_rounds, no_loops, _ = run("prompt_lookup", 1, [early])
    looped, loop_rounds, loops, stats = run("prompt_lookup", 4, [early])
    assert looped == hosted == target_only and {reason for _, reason in looped} == {"eos", "length"}
    assert no_loops == 0 < loops and loop_rounds < host_rounds
    assert stats.drafted_by.get("prompt_lookup", 0) > 0
    assert run("suffix", 4, [early])[2] == 0  # other drafters keep their rounds on the host
    short = run("prompt_lookup", 4, [early], gamma_max=1)  # verify passes of width 2
    assert short[0] == target_only and short[2] > 0 and short[3].gamma_histogram.keys() <= {0, 1}


@pytest.mark.parametrize("path", ["static", "dynamic"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_rounds_without_drafts_run_their_passes_back_to_back_with_the_same_outputs(pairs, path, batch_size):
    """A greedy round that drafts nothing makes `plain_steps` passes back to back: target-only
    and `auto` give the outputs of one pass a round, with rows ending at an EOS inside the
    passes (an EOS the one-pass run emits early), in fewer rounds. By default only captured
    graphs do (a GPU's static path): here, a pass a round."""
    loaded = pairs[0 if path == "static" else 1]
    prompts = [loaded.tokenizer(t).input_ids for t in TEXTS]

    def run(drafter, steps, eos):
        config = EngineConfig(drafter=drafter, gamma_max=6, plain_steps=steps)
        engine = SpeculativeEngine(
            loaded.target, loaded.draft, eos_token_ids=eos, pad_token_id=0, config=config
        )
        rounds, round_ = [0], engine._round
        engine._round = lambda batch: (rounds.__setitem__(0, rounds[0] + 1), round_(batch))
        done, stats = engine.generate(prompts, MAX_NEW, batch_size=batch_size)
        assert stats.new_tokens == sum(len(o.tokens) for o in done)
        return [(o.tokens, o.finish_reason) for o in done], rounds[0], stats

    early = run("none", 1, [1])[0][0][0][2]  # the first row's third token ends rows now
    for drafter in ("none", "auto"):
        one, one_rounds, _ = run(drafter, 1, [early])
        together, together_rounds, stats = run(drafter, 4, [early])
        assert together == one and any(reason == "eos" for _, reason in one)
        assert together_rounds < one_rounds
        if drafter == "none":
            assert stats.target_passes >= stats.new_tokens / batch_size and stats.asking_seconds == 0
            assert run(drafter, None, [early])[1] == one_rounds  # the default on a CPU
