"""What the main commands and the lab's share: exit codes and `--storage-option`.

Exit codes: 0 success, 1 the job ran but failed (some shard failed, or the cluster job
failed), 2 usage or job-spec error (nothing was started).
"""

from __future__ import annotations

import sys

import click

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def parse_storage_options(items: tuple[str, ...]) -> dict:
    """--storage-option KEY=VALUE pairs; values parsed as YAML scalars (true, 3, text)."""
    import yaml

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            click.echo(f"--storage-option: expected KEY=VALUE, got {item!r}", err=True)
            sys.exit(EXIT_USAGE)
        options[key.strip()] = yaml.safe_load(value) if value else ""
    return options


storage_option = click.option(
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec/s3fs option for OUTPUT_URL, e.g. endpoint_url=http://host:9000 (repeatable; "
    "no credentials).",
)
