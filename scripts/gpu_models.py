"""The models a GPU check runs, which must travel in a 64 MiB working tree (docs/gpu.md).

    python3 scripts/gpu_models.py prepare [PAIR_DIR]   here: the Qwen2.5-Coder pair's configs and
                                                       tokenizer into .gpu-carry/ (ignored by git),
                                                       the packages the GPU machine lacked,
                                                       unpacked into .gpu-carry/site, and Ray
                                                       packed as .gpu-carry/ray.tar.xz
    python3 scripts/gpu_models.py build OUT            there: random-weight models of those shapes
                                                       under OUT/models, a pair config under OUT/config

The real weights (1.6 GB) cannot travel; configs and tokenizer can, and random weights of the
same shapes cost what the real ones cost per pass. Their acceptance (about 0) and their text are
not real, and their nearly flat logits make them a harsh test of exactness.
"""

from __future__ import annotations

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


def prepare(pair_dir: Path) -> None:
    for role in ("target", "draft"):
        (CARRY / role).mkdir(parents=True, exist_ok=True)
        for name in FILES:
            source = pair_dir / role / name
            if name == "tokenizer.json" and role == "draft":
                continue  # the same file as the target's: carried once
            if source.exists():
                shutil.copy(source, CARRY / role / name)
    print(f"{CARRY}: {sum(f.stat().st_size for f in CARRY.rglob('*') if f.is_file()) / 1e6:.1f} MB")


# What `python3 -m pipeline.cli` imports that the GPU machine lacked (2026-11-27: tenacity,
# pydantic), and pytest-xdist for the tests; unpacked, since `pip` there serves another python.
SITE = Path(".gpu-carry/site")
PACKAGES = ("pydantic", "click", "pyyaml", "tenacity", "fsspec", "pytest-xdist")
PLATFORM = ("--python-version", "3.12", "--platform", "manylinux2014_x86_64")
PLATFORM += ("--platform", "manylinux_2_17_x86_64")
# the machine's own typing_extensions and pytest serve torch and the tests
KEEP_THEIRS = ("typing_extensions", "pytest-", "pluggy", "iniconfig", "packaging")


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


def build(out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    paths = {}
    for role in ("target", "draft"):
        path = out / "models" / f"qwen-{role}"
        paths[role] = path
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
        print(f"{role}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters at {path}")
        del model
    config_dir = out / "config"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "models.yaml").write_text(
        f"pairs:\n  {PAIR}:\n    target: {paths['target']}\n    draft: {paths['draft']}\n"
        f"  qwen-shaped-target:\n    target: {paths['target']}\n"
    )
    print(f"pairs {PAIR}, qwen-shaped-target in {config_dir / 'models.yaml'}")


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "prepare":
        default = Path.home() / ".cache/spec-pipeline/models/qwen2.5-coder"
        prepare(Path(sys.argv[2]) if len(sys.argv) > 2 else default)
        fetch_site()
        fetch_ray()
    elif what == "build" and len(sys.argv) == 3:
        build(Path(sys.argv[2]))
    else:
        sys.exit(__doc__)
