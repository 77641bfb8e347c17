"""Credentials: the one list of option names that carry them, and the one redaction.

Credentials come only from the environment (``AWS_ACCESS_KEY_ID`` ...), ``~/.aws`` or a named
``profile``, never from a job spec or ``storage_options`` (they would end up in manifests, logs
and pickles). The spec rejects them field by field (:func:`find_credentials`), :class:`Storage`
refuses them (:func:`check_no_credentials`), :func:`redact` takes them out of any text shown
(error messages, logs) and :func:`redact_options` out of a mapping written to storage (the spec
copy in ``manifest.json``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from pipeline.storage.urls import split_scheme

# Option names that carry credentials (compared case-insensitively, at any nesting level) ...
CREDENTIAL_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "username",
        "password",
        "passwd",
        "access_key",
        "secret_key",
        "session_token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "account_key",
        "sas_token",
        "credentials",
    }
)
# ... and any name that contains one of these.
CREDENTIAL_SUBSTRINGS = ("secret", "password", "passwd", "token", "credential", "access_key", "private_key")
CREDENTIALS_HINT = (
    "credentials come only from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_SESSION_TOKEN, AWS_PROFILE) or the standard AWS config files, never from the job spec"
)


def is_credential_key(key: str) -> bool:
    k = key.lower()
    return k in CREDENTIAL_KEYS or any(s in k for s in CREDENTIAL_SUBSTRINGS)


def has_userinfo(url: str) -> bool:
    """True for a URL with ``user[:password]@`` before its host."""
    scheme, rest = split_scheme(url)
    if scheme is None:
        return False
    authority = rest.split("/", 1)[0]
    return "@" in authority


def find_credentials(obj: Any, prefix: str = "") -> list[str]:
    """Dotted names of credential-looking keys (and URLs with user:password@) anywhere in obj."""
    found: list[str] = []
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            name = f"{prefix}{k}"
            if isinstance(k, str) and is_credential_key(k):
                found.append(name)
            else:
                found.extend(find_credentials(v, name + "."))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found.extend(find_credentials(v, f"{prefix}[{i}]."))
    elif isinstance(obj, str) and has_userinfo(obj):
        found.append(prefix.rstrip(".") or "<value>")
    return found


def check_no_credentials(options: Mapping[str, Any], where: str = "storage_options") -> None:
    """ValueError naming the first credential key in ``options`` (at any nesting level)."""
    for name, value in options.items():
        if is_credential_key(str(name)):
            raise ValueError(
                f"{where} must not carry credentials ({name!r}): set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN) in the environment, or use a profile"
            )
        if isinstance(value, Mapping):
            check_no_credentials(value, f"{where}[{name!r}]")


def redact_options(obj: Any) -> Any:
    """A copy of a mapping (or list) with the value of every credential key as ``<redacted>``."""
    if isinstance(obj, dict):
        return {k: ("<redacted>" if is_credential_key(str(k)) else redact_options(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_options(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------
# redaction of text

_SECRET_ENV_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

# Names of key=value / key: value pairs whose value is a credential.  Deliberately not a bare
# "key" (S3 object keys are fine to show) nor "tokens" (this project counts tokens).
_CRED_NAME = (
    r"(?:[\w-]*?(?:secret|passw(?:or)?d)[\w-]*"
    r"|[\w-]*?(?:session|security|auth|access|refresh|bearer|api|id)[_-]?token"
    r"|token"
    r"|[\w-]*?access[_-]?key(?:[_-]?id)?"
    r"|[\w-]*?api[_-]?key"
    r"|x-amz-credential|x-amz-signature|x-amz-security-token|signature|credentials?)"
)
_CRED_PAIR = re.compile(r"(?i)(?<![\w-])(" + _CRED_NAME + r")(['\"]?\s*[:=]\s*['\"]?)([^\s'\",;&}\])]+)")
# AWS access key ids have a recognisable shape even without a name next to them.
_AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)[0-9A-Z]{16}\b")


def redact(text: str) -> str:
    """Return ``text`` with credentials replaced by ``***``.

    Replaced: the values of AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN found
    in ``os.environ`` (wherever they appear), the value of any credential-looking ``name=value``
    or ``name: value`` pair (secret, password, *token, access_key(_id), signature, credential,
    X-Amz-Signature ...), and anything shaped like an AWS access key id.
    """
    text = str(text)
    values = {os.environ.get(name, "") for name in _SECRET_ENV_VARS}
    # Longest first so that a value containing another one is replaced whole; very short
    # values are skipped (replacing "a" everywhere would wreck the message, not protect it).
    for value in sorted((v for v in values if len(v) >= 4), key=len, reverse=True):
        text = text.replace(value, "***")
    text = _CRED_PAIR.sub(lambda m: m.group(1) + m.group(2) + "***", text)
    return _AWS_KEY_ID.sub("***", text)
