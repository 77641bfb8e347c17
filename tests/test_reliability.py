"""The input corpus is never touched, a resume is checked against its spec, every row is
accounted for (issue 22). Real files, real Parquet, the real CLI; a real local Ray and the tiny
models where a job has to run, the loopback S3 server where the item is about S3.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pipeline_helpers import DOCS, job_dict

from pipeline.cli import main
from pipeline.job.executor import JobResult, plan, run_job, write_manifest
from pipeline.job.fingerprint import check_resume, fingerprint
from pipeline.job.worker import build_processor
from pipeline.spec import SpecError, spec_from_dict
from pipeline.storage import Storage


def write_shards(store: Storage, shards: int = 2, rows: int = 2) -> dict[str, bytes]:
    """Small clean shards; returns their bytes so a test can prove they were never touched."""
    for s in range(shards):
        ids = [f"s{s}r{r}" for r in range(rows)]
        store.write_parquet(f"part-{s:03d}.parquet", pa.table({"id": ids, "text": DOCS[:rows]}))
    return {n: store.read_bytes(n) for n in store.list()}


def spec_file(tmp_path: Path, tiny_pair_dirs, input_url: str, output_url: str, **extra) -> str:
    data = job_dict(tiny_pair_dirs, input_url, output_url)
    data["input"]["keep_columns"] = []
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(data))
    return str(path)


# -- item 1: overlapping prefixes, and --overwrite deleting only what a job wrote ----------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_output_containing_the_input_is_refused_and_the_input_kept(tiny_pair_dirs, tmp_path, overwrite):
    """Input X/outputs, output X: the run would replace the input shards with output records."""
    before = write_shards(Storage(str(tmp_path / "X" / "outputs")))
    path = spec_file(tmp_path, tiny_pair_dirs, str(tmp_path / "X" / "outputs"), str(tmp_path / "X"))
    runner = CliRunner()
    validate = runner.invoke(main, ["validate", path, "--no-models"])
    assert validate.exit_code == 2, validate.output
    assert "output.url: must not be, contain or be inside the input location" in validate.output
    run = runner.invoke(main, ["run", path, "--no-progress", *(["--overwrite"] if overwrite else [])])
    assert run.exit_code == 2 and "output.url" in run.output and "Traceback" not in run.output
    store = Storage(str(tmp_path / "X" / "outputs"))
    assert {n: store.read_bytes(n) for n in store.list()} == before


def overlap_cases(tmp: Path) -> dict[str, tuple[str, str]]:
    """(input url, output url) pairs that name overlapping places in different spellings."""
    (tmp / "in").mkdir(exist_ok=True)
    os.symlink(tmp / "in", tmp / "link-to-in")
    os.symlink(tmp, tmp / "link-to-parent")
    return {
        "symlink to the input": (str(tmp / "in"), str(tmp / "link-to-in")),
        "inside a symlink to the input": (str(tmp / "in"), str(tmp / "link-to-in" / "out")),
        "input through a symlinked parent": (str(tmp / "link-to-parent" / "in"), str(tmp)),
        "file:// output containing the input": (str(tmp / "in"), f"file://{tmp}"),
        "relative output equal to the input": (str(tmp / "in"), "./in"),
        "glob input inside the output": (str(tmp / "in" / "part-*.parquet"), str(tmp)),
        "glob input's directory is the output": (str(tmp / "in" / "*.parquet"), str(tmp / "in")),
        "s3 output containing the input": ("s3://bucket/X/outputs/", "s3://bucket/X"),
        "s3 bucket root as output": ("s3://bucket/corpus/part-*.parquet", "s3://bucket"),
    }


def test_overlap_is_found_whatever_the_spelling(tiny_pair_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for case, (input_url, output_url) in overlap_cases(tmp_path).items():
        with pytest.raises(SpecError, match="output.url: must not be, contain or be inside") as err:
            spec_from_dict(job_dict(tiny_pair_dirs, input_url, output_url))
        assert len(err.value.errors) == 1, case
    # neighbours that merely share a name prefix are fine
    spec_from_dict(job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "in-results")))
    spec_from_dict(job_dict(tiny_pair_dirs, "s3://bucket/X/outputs/", "s3://bucket/X/out"))


def test_overwrite_deletes_only_what_a_job_wrote_and_refuses_foreign_files(tiny_pair_dirs, tmp_path):
    write_shards(Storage(str(tmp_path / "in")))
    out = Storage(str(tmp_path / "out"))
    ours = [
        "outputs/part-000.parquet",
        "errors/part-000.parquet",
        "stats/part-000.json",
        "failed/part-001.json",
        "report/report.html",
        "report/figures/acceptance.png",
        "manifest.json",
        "_SUCCESS",
    ]
    for name in ours:
        out.write_bytes(name, b"{}")
    out.write_bytes("notes/keep-me.txt", b"someone else's")
    out.write_bytes(".hidden-config", b"someone else's too")
    path = spec_file(tmp_path, tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"))

    run = CliRunner().invoke(main, ["run", path, "--overwrite", "--no-progress"])
    assert run.exit_code == 2, run.output
    assert "output.url: --overwrite refused" in run.output and "notes/keep-me.txt" in run.output
    assert ".hidden-config" in run.output and "Traceback" not in run.output
    assert sorted(out.list(hidden=True)) == sorted([*ours, "notes/keep-me.txt", ".hidden-config"])

    # the spec's own output.overwrite is checked by validate too, before anything runs
    with_overwrite = spec_file(
        tmp_path, tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), output={"overwrite": True}
    )
    validate = CliRunner().invoke(main, ["validate", with_overwrite, "--no-models"])
    assert validate.exit_code == 2 and "output.overwrite would be refused" in validate.output

    out.delete_prefix("notes")
    out.delete(".hidden-config")
    spec = spec_from_dict(json.loads(Path(path).read_text()))
    todo, shards, _ = plan(spec.with_absolute_paths(), overwrite=True)
    assert todo == shards and len(todo) == 2
    assert out.list(hidden=True) == []
    assert CliRunner().invoke(main, ["validate", with_overwrite, "--no-models"]).exit_code == 0


# -- item 3: wrong-typed text, input rows counted, max_new_tokens against the context --------


@pytest.fixture(scope="module")
def processor(tiny_pair_dirs, tmp_path_factory):
    """A shard processor for the tiny pair, as a model actor builds it, over integer ids."""
    root = tmp_path_factory.mktemp("processor")
    data = job_dict(tiny_pair_dirs, str(root / "in"), str(root / "out"), batch_size=4)
    data["input"]["keep_columns"] = []
    return build_processor(spec_from_dict(data).with_absolute_paths()), root


def corrupt_pages(table: pa.Table) -> bytes:
    """A Parquet file whose footer reads (so its row count is known) but whose pages do not."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="none")
    data = bytearray(sink.getvalue().to_pybytes())
    data[4:60] = b"\xff" * 56
    return bytes(data)


def test_wrong_typed_text_gives_row_errors_and_unreadable_rows_are_counted(processor):
    processor, root = processor
    inp, out = Storage(str(root / "in")), Storage(str(root / "out"))
    inp.write_parquet("ints.parquet", pa.table({"id": [7, 8, 9], "text": pa.array([1, None, 3], pa.int64())}))
    stats = processor.process(str(root / "in" / "ints.parquet"), "ints")
    assert stats["status"] == "ok" and stats["rows_in"] == 3 and stats["rows_out"] == 0
    errors = out.read_parquet("errors/ints.parquet").to_pylist()
    assert [(e["id"], e["reason"]) for e in errors] == [
        ("7", "text_not_string"),
        ("8", "null_text"),
        ("9", "text_not_string"),
    ]
    assert errors[0]["detail"] == "text is int64, not a string"

    inp.write_parquet("renamed.parquet", pa.table({"id": [1, 2], "body": ["a", "b"]}))
    inp.write_bytes("pages.parquet", corrupt_pages(pa.table({"id": [1, 2, 3, 4], "text": list("abcd")})))
    inp.write_bytes("garbage.parquet", b"PAR1 not parquet at all")
    counts = {
        name: processor.process(str(root / "in" / f"{name}.parquet"), name)["rows_in"]
        for name in ("renamed", "pages", "garbage")
    }
    assert counts == {"renamed": 2, "pages": 4, "garbage": 0}

    spec = processor.spec
    result = JobResult(spec.output.url, shards_total=4, shards_skipped=0)
    write_manifest(spec, out, result, began=0.0)
    totals = out.read_json("manifest.json")["totals"]
    assert totals["rows_in"] == 3 + 2 + 4 and totals["rows_in_unreadable"] == 6


def test_max_new_tokens_beyond_the_context_is_a_spec_error(tiny_pair_dirs, tmp_path):
    write_shards(Storage(str(tmp_path / "in")))
    path = spec_file(
        tmp_path,
        tiny_pair_dirs,
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        generation={"max_new_tokens": 1024},
    )
    runner = CliRunner()
    for command in (["validate", path, "--no-models"], ["run", path, "--no-progress"]):
        result = runner.invoke(main, command)
        assert result.exit_code == 2, result.output
        assert "generation.max_new_tokens: 1024 does not fit the target's context of 1024" in result.output
    assert not Path(tmp_path / "out").exists()
    fits = spec_file(
        tmp_path,
        tiny_pair_dirs,
        str(tmp_path / "in"),
        str(tmp_path / "out"),
        generation={"max_new_tokens": 1023},
    )
    assert runner.invoke(main, ["validate", fits, "--no-models"]).exit_code == 0


# -- items 5 and 7: one outputs schema per job, and a report over integer ids ------------------


def test_integer_ids_one_outputs_schema_and_the_report(tiny_pair_dirs, tmp_path, ray_local):
    inp = Storage(str(tmp_path / "in"))
    inp.write_parquet("part-000.parquet", pa.table({"id": [1, 2, 3], "text": DOCS[:3], "title": list("abc")}))
    inp.write_parquet("part-001.parquet", pa.table({"id": [1], "text": ["x"], "title": ["a"]}).slice(0, 0))
    inp.write_bytes("part-002.parquet", b"PAR1 not parquet")
    inp.write_parquet("part-003.parquet", pa.table({"id": [4], "body": ["no text column"], "title": ["d"]}))
    inp.write_parquet("part-004.parquet", pa.table({"id": ["x5"], "text": [DOCS[4]], "title": ["e"]}))
    inp.write_parquet("part-005.parquet", pa.table({"id": [6], "text": [" "], "title": [None]}))
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"))
    result = run_job(spec_from_dict(data), progress=False)
    assert result.ok and len(result.done) == 6

    outputs = tmp_path / "out" / "outputs"
    schemas = {p.name: pq.read_schema(p) for p in sorted(outputs.glob("*.parquet"))}
    assert len(schemas) == 6
    first = schemas["part-000.parquet"]
    assert first.field("id").type == pa.int64() and first.names[:3] == ["id", "title", "generated"]
    assert all(schema.equals(first) for schema in schemas.values()), schemas
    table = pq.read_table(outputs)  # as a downstream reader would: every column, every row
    assert table.schema.names == first.names and sorted(table.column("id").to_pylist()) == [1, 2, 3]
    stats = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "out" / "stats").glob("*.json")}
    assert "id is string where the job's first shard has int64" in stats["part-004"]["error"]

    report = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert report.exit_code == 0, report.output


# -- item 4: a resume is checked against the spec that wrote the run ---------------------------


def test_resume_with_another_spec_is_refused_unless_overwritten(tiny_pair_dirs, tmp_path, ray_local):
    write_shards(Storage(str(tmp_path / "in")), shards=1, rows=1)
    first = spec_file(tmp_path, tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out" / "{run_id}"))
    runner = CliRunner()
    ran = runner.invoke(main, ["run", first, "--run-id", "r1", "--no-progress"])
    assert ran.exit_code == 0, ran.output
    out = Storage(str(tmp_path / "out" / "r1"))
    manifest = out.read_json("manifest.json")
    assert manifest["fingerprint"]["fields"]["generation.max_new_tokens"] == 12
    assert len(manifest["fingerprint"]["sha256"]) == 64 and manifest["finished"] is not None

    target, draft = tiny_pair_dirs
    changed = ["--set", "generation.max_new_tokens=6", "--set", f"models.target={draft}"]
    refused = runner.invoke(main, ["run", first, "--run-id", "r1", "--no-progress", *changed])
    assert refused.exit_code == 2, refused.output
    assert "resume refused" in refused.output and "Traceback" not in refused.output
    assert "generation.max_new_tokens: 12 -> 6" in refused.output
    assert f'models.target.path: "{target}" -> "{draft}"' in refused.output
    assert out.read_json("manifest.json") == manifest  # still describes the outputs

    # the same spec resumes (nothing to do), and --overwrite redoes the run under the new spec
    same = runner.invoke(main, ["run", first, "--run-id", "r1", "--no-progress"])
    assert same.exit_code == 0, same.output
    # outputs written by a version with other columns (here: before generated_ids) are refused
    written = out.read_parquet("outputs/part-000.parquet")
    out.write_parquet("outputs/part-000.parquet", written.drop_columns(["generated_ids"]))
    older = runner.invoke(main, ["run", first, "--run-id", "r1", "--no-progress"])
    assert older.exit_code == 2 and "other columns than this version's" in older.output, older.output
    assert "generated_ids" in older.output.splitlines()[-2] and "Traceback" not in older.output
    overwrite = ["run", first, "--run-id", "r1", "--no-progress", "--overwrite", *changed[:2]]
    again = runner.invoke(main, overwrite)
    assert again.exit_code == 0, again.output
    assert out.read_json("manifest.json")["fingerprint"]["fields"]["generation.max_new_tokens"] == 6
    assert out.read_parquet("outputs/part-000.parquet").column("new_tokens").to_pylist()[0] <= 6


def test_a_resume_across_an_upgrade_that_added_a_field_goes_on_at_its_default(tiny_pair_dirs, tmp_path):
    """An older version's manifest lacks the fields added since: at their defaults they are
    what that run decoded with, so the resume goes on; set otherwise, it is refused."""
    spec = spec_from_dict(job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out")))
    old_fields = fingerprint(spec)["fields"]
    added = ["drafter.suffix_max_tokens", "drafter.suffix_warm_start", "execution.speedup_sample_tokens"]
    for key in added:
        del old_fields[key]
    manifest = {"run_id": "r1", "fingerprint": {"fields": old_fields}}
    check_resume(spec, manifest)  # no error

    changed = spec_from_dict(
        {
            **job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out")),
            "drafter": {"kind": "auto", "gamma_max": 4, "adaptive": False, "suffix_max_tokens": 1000},
        }
    )
    with pytest.raises(SpecError) as refused:
        check_resume(changed, manifest)
    assert "drafter.suffix_max_tokens: (absent) -> 1000" in str(refused.value)
    assert "suffix_warm_start" not in str(refused.value)
    # a manifest from before fingerprints existed is compared through its spec, the same way
    old_spec = spec.to_dict()
    del old_spec["drafter"]["suffix_max_tokens"], old_spec["execution"]["speedup_sample_tokens"]
    check_resume(spec, {"run_id": "r0", "spec": old_spec})
    with pytest.raises(SpecError):
        check_resume(changed, {"run_id": "r0", "spec": old_spec})


# -- item 2: ids unique per job ------------------------------------------------------------------


def test_an_id_already_in_an_earlier_shard_is_a_duplicate_error_whatever_finishes_first(
    tiny_pair_dirs, tmp_path, ray_local
):
    inp = Storage(str(tmp_path / "in"))
    inp.write_parquet("part-000.parquet", pa.table({"id": ["a", "b", "a"], "text": DOCS[:3]}))
    inp.write_parquet("part-001.parquet", pa.table({"id": ["b", "c"], "text": DOCS[3:5]}))
    third = pa.table({"id": ["c", "a", "d"], "text": ["", DOCS[0], DOCS[1]]})
    inp.write_parquet("sub/part-002.parquet", third)
    data = job_dict(tiny_pair_dirs, str(tmp_path / "in"), str(tmp_path / "out"), num_actors=2)
    data["input"]["keep_columns"] = []
    spec = spec_from_dict(data)
    out = Storage(str(tmp_path / "out"))

    def records() -> tuple[list, list]:
        outputs = sorted(i for n in out.list("outputs") for i in out.read_parquet(n).column("id").to_pylist())
        errors = sorted(
            (n.rsplit("/", 1)[-1], e["id"], e["reason"], e["detail"])
            for n in out.list("errors")
            for e in out.read_parquet(n).to_pylist()
        )
        return outputs, errors

    assert run_job(spec, progress=False).ok
    first = records()
    assert first == (
        ["a", "b", "c", "d"],
        [
            ("part-000.parquet", "a", "duplicate_id", "id 'a' already appeared in this shard"),
            ("part-001.parquet", "b", "duplicate_id", "id 'b' is already in shard part-000"),
            ("sub__part-002.parquet", "a", "duplicate_id", "id 'a' is already in shard part-000"),
            ("sub__part-002.parquet", "c", "duplicate_id", "id 'c' is already in shard part-001"),
        ],
    )
    # part-001 holds "c" even though its row in sub/part-002 is an error (empty text) itself:
    # who keeps an id depends on the listing only. Redo the first shard last: it still keeps its ids.
    out.delete("stats/part-000.json")
    again = run_job(spec, progress=False)
    assert [s["shard"] for s in again.done] == ["part-000"]
    assert records() == first


# -- item 8: `pipeline stats` on S3: storage options, clean errors, honest exit codes ------------


def test_stats_on_s3_errors_cleanly_and_exits_non_zero_unless_complete(processor, s3_server, monkeypatch):
    processor, root = processor
    Storage(str(root / "in")).write_parquet("good.parquet", pa.table({"id": [1], "text": [DOCS[0]]}))
    processor.process(str(root / "in" / "good.parquet"), "good")
    local = Storage(str(root / "out"))
    bucket = s3_server.make_bucket("stats")
    remote = Storage(f"s3://{bucket}/run/", s3_server.storage_options)
    remote.write_bytes("stats/good.json", local.read_bytes("stats/good.json"))
    remote.write_json("failed/bad.json", {"shard": "bad", "attempts": 3, "reason": "model actor died: OOM"})

    monkeypatch.delenv("AWS_ENDPOINT_URL")  # the endpoint must come from --storage-option
    endpoint = ["--storage-option", f"endpoint_url={s3_server.endpoint}"]
    runner = CliRunner()

    def stats(url: str, *args: str):
        result = runner.invoke(main, ["stats", url, *args])
        assert isinstance(result.exception, (SystemExit, type(None))), result.output
        return result

    failed = stats(f"s3://{bucket}/run/", *endpoint)
    assert failed.exit_code == 1 and "bad" in failed.output and "FAILED after 3 attempt(s)" in failed.output
    assert "model actor died: OOM" in failed.output and "good" in failed.output
    as_json = stats(f"s3://{bucket}/run/", "--json", *endpoint)
    assert as_json.exit_code == 1 and '"shard": "bad"' in as_json.output

    remote.delete("failed/bad.json")
    assert "incomplete: no _SUCCESS" in stats(f"s3://{bucket}/run", *endpoint).output
    remote.write_bytes("_SUCCESS", b"")
    done = stats(f"s3://{bucket}/run", "--json", *endpoint)
    assert done.exit_code == 0 and json.loads(done.output)["complete"] is True

    missing = stats(f"s3://{bucket}/nothing-here", "--json", *endpoint)
    assert missing.exit_code == 1 and "no stats under s3://" in missing.output
    no_bucket = stats("s3://no-such-bucket-here/run", *endpoint)
    assert no_bucket.exit_code == 1 and no_bucket.output.startswith("pipeline stats: ")
    assert "bucket does not exist" in no_bucket.output and len(no_bucket.output.strip().splitlines()) == 1
    bad_option = stats(f"s3://{bucket}/run", "--storage-option", "endpoint_url")
    assert bad_option.exit_code == 2 and "expected KEY=VALUE" in bad_option.output
    secret = stats(f"s3://{bucket}/run", "--storage-option", "secret=x", *endpoint)
    assert secret.exit_code == 1 and "must not carry credentials" in secret.output
