"""A job of 10⁵ rows in 1,000 shards on the tests' tiny pair, submitted to a Ray head through
the Jobs API as a user's would be, to measure what a large corpus costs the driver rather than
the models (issue 38; figures in docs/reliability.md, "A corpus of 10⁵ rows").

    python scripts/scale_run.py WORKDIR [--shards 1000] [--rows 100] [--max-new-tokens 4]
        [--report docs/benchmarks/NAME]

Measures, while the job runs and after it:
- the driver's resident memory (the `pipeline run` process the Jobs API started), sampled
  every second: peak and last;
- per-shard overhead, from the shards' own stats: on each actor, the gap between one shard's
  end and the next one's start (dispatch, the driver's bookkeeping, the call's round trip), and
  in each shard the time outside decoding (reading the shard, writing outputs, errors, stats);
  and the job's wall time per shard beyond the actors' busy time;
- `pipeline status` latency (the whole command, and its in-process `job_status` call) during
  the job and at its end;
- `pipeline stats` latency at the end, and the manifest's size.

Writes NAME.json and NAME.md (`--report`), naming the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def build(work: Path, shards: int, rows: int, max_new_tokens: int) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "scripts"))
    from tiny_job import write_corpus
    from tiny_models import build_tiny_pair

    target, draft = build_tiny_pair(work / "models")
    data = work / "data"
    shutil.rmtree(data, ignore_errors=True)
    write_corpus(data, shards, rows, sentences=(2, 5))
    spec = work / "job.yaml"
    spec.write_text(
        "name: scale\n"
        f"input: {{url: {data}, text_column: text, id_column: id}}\n"
        "task: {kind: summarize, max_input_tokens: 128}\n"
        f"generation: {{max_new_tokens: {max_new_tokens}, greedy: true}}\n"
        f"models: {{target: {target}, draft: {draft}, dtype: float32, device: cpu}}\n"
        "drafter: {kind: none}\n"
        "execution: {num_actors: 2, num_cpus: 1, batch_size: 50}\n"
        f'output:\n  url: "{work}/out/{{run_id}}"\n  overwrite: true\n'
    )
    return spec


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Head:
    """A `ray start --head` with the dashboard (Jobs API) on loopback, stopped on exit."""

    def __init__(self, cpus: int):
        self.temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
        self.port = _free_port()
        ray_bin = str(Path(sys.executable).parent / "ray")
        command = [ray_bin, "start", "--head", f"--num-cpus={cpus}", "--include-dashboard=true"]
        command += ["--dashboard-host=127.0.0.1", f"--dashboard-port={self.port}", f"--temp-dir={self.temp}"]
        command += [f"--port={_free_port()}", "--disable-usage-stats"]
        subprocess.run(command, env=ENV, check=True, capture_output=True, timeout=180)
        self.address = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        ray_bin = str(Path(sys.executable).parent / "ray")
        subprocess.run([ray_bin, "stop", "--force"], env=ENV, capture_output=True, timeout=120)
        shutil.rmtree(self.temp, ignore_errors=True)


class DriverMemory(threading.Thread):
    """Samples the resident memory of the job's driver (`pipeline.cli run env:...`) each second."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        import psutil

        began = time.monotonic()
        while not self.stopped.wait(1.0):
            found = []
            for proc in psutil.process_iter(["cmdline"]):
                cmd = proc.info["cmdline"] or []
                # the driver itself, not the shell the Jobs API starts it through
                if cmd and "python" in Path(cmd[0]).name and "pipeline.cli" in cmd and "run" in cmd:
                    try:
                        found.append(proc.memory_info().rss)
                    except psutil.Error:
                        pass
            if found:
                self.samples.append((time.monotonic() - began, max(found)))


def _timed(command: list[str]) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run(command, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return time.perf_counter() - began, done.stdout + done.stderr


def _status_latency(address: str, job_id: str) -> dict:
    from pipeline.cluster.jobs_api import job_status

    began = time.perf_counter()
    info = job_status(address, job_id)
    call = time.perf_counter() - began
    command, _ = _timed([sys.executable, "-m", "pipeline.cli", "status", job_id, "--address", address])
    return {
        "shards_done": info.get("shards_done"),
        "call_seconds": round(call, 3),
        "command_seconds": round(command, 3),
    }


def overhead(stats: list[dict]) -> dict:
    """Per-shard overhead from the shards' stats (each names its actor's pid and its start and end)."""
    by_actor: dict[int, list[tuple[float, float]]] = {}
    outside = []
    for s in stats:
        start, end = s["started"], s["finished"]
        by_actor.setdefault(s["worker"]["pid"], []).append((start, end))
        # the speedup sample's own cost (its target-only halves) is measurement, not overhead
        outside.append((end - start) - s["decode_seconds"] - (s.get("speedup") or {}).get("seconds", 0.0))
    gaps = []
    busy = 0.0
    for spans in by_actor.values():
        spans.sort()
        busy += sum(e - s for s, e in spans)
        gaps += [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    actors = len(by_actor)
    phase = max(s["finished"] for s in stats) - min(s["started"] for s in stats)
    return {
        "shards": len(stats),
        "actors": actors,
        "gap_between_shards_ms": {"median": _ms(statistics.median(gaps)), "p95": _ms(_pct(gaps, 0.95))},
        "in_shard_outside_decoding_ms": {
            "median": _ms(statistics.median(outside)),
            "p95": _ms(_pct(outside, 0.95)),
        },
        "decode_seconds_total": round(sum(s["decode_seconds"] for s in stats), 1),
        "actor_busy_seconds_total": round(busy, 1),
        "shard_phase_seconds": round(phase, 1),  # the first shard's start to the last one's end
        # that time beyond what the actors spent in shards, per shard, summed over the actors
        "idle_ms_per_shard": _ms((phase * actors - busy) / len(stats)),
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("work", type=Path)
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--status-every", type=float, default=120.0, help="seconds between status timings")
    parser.add_argument("--report", type=Path, help="write REPORT.json and REPORT.md")
    args = parser.parse_args()
    from pipeline.machine import cpu_info, git_state

    commit, dirty = git_state()  # the code the job is submitted with, whatever the tree becomes
    spec = build(args.work, args.shards, args.rows, args.max_new_tokens)
    head = Head(cpus=2)
    memory = DriverMemory()
    try:
        submit = [sys.executable, "-m", "pipeline.cli", "submit", str(spec), "--address", head.address]
        submit += ["--run-id", "scale"]
        done = subprocess.run(
            submit, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
        )
        job_id = next(w for w in done.stdout.split() if w.startswith("raysubmit_"))
        began = time.monotonic()
        memory.start()
        from ray.job_submission import JobStatus

        from pipeline.cluster.jobs_api import _client

        client = _client(head.address)  # with the cluster's token, as `pipeline status` does
        statuses, next_status = [], began + 30
        while client.get_job_status(job_id) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            if time.monotonic() >= next_status:
                statuses.append(
                    {"at_seconds": round(time.monotonic() - began), **_status_latency(head.address, job_id)}
                )
                next_status = time.monotonic() + args.status_every
                print(json.dumps(statuses[-1]), flush=True)
            time.sleep(1)
        wall = time.monotonic() - began
        memory.stopped.set()
        state = str(client.get_job_status(job_id).value)
        final_status = _status_latency(head.address, job_id)
        logs_tail = client.get_job_logs(job_id)[-3000:]
    finally:
        memory.stopped.set()
        head.stop()
    out = args.work / "out" / "scale"
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    stats_seconds, _ = _timed([sys.executable, "-m", "pipeline.cli", "stats", str(out)])
    stats = [json.loads(p.read_text()) for p in sorted((out / "stats").glob("*.json"))]
    rss = [r for _, r in memory.samples]
    model, flags = cpu_info()
    record = {
        "command": " ".join(["python", "scripts/scale_run.py", *sys.argv[1:]]),
        "machine": {
            "cpu_model": model,
            "avx2": "avx2" in flags,
            "avx512_bf16": "avx512_bf16" in flags,
            "cores": os.cpu_count(),
        },
        "commit": commit,
        "dirty": dirty,
        "job": {"id": job_id, "state": state, "wall_seconds": round(wall, 1), "logs_tail": logs_tail},
        "corpus": {"shards": args.shards, "rows_per_shard": args.rows, "max_new_tokens": args.max_new_tokens},
        "totals": {
            k: manifest["totals"].get(k)
            for k in ("shards", "rows_in", "rows_out", "rows_error", "tokens_out")
        },
        "complete": (out / "_SUCCESS").exists(),
        "driver_rss_mb": {
            "peak": round(max(rss) / 2**20, 1) if rss else None,
            "last": round(rss[-1] / 2**20, 1) if rss else None,
            "samples": len(rss),
            "by_minute": [round(r / 2**20, 1) for r in rss[::60]],
        },
        "overhead": overhead(stats),
        "status_during_job": statuses,
        "status_at_end": final_status,
        "stats_command_seconds": round(stats_seconds, 2),
        "manifest_bytes": manifest_path.stat().st_size,
    }
    print(json.dumps({k: v for k, v in record.items() if k != "job"}, indent=1))
    if args.report:
        args.report.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
        args.report.with_suffix(".md").write_text(_markdown(record))
        print(f"wrote {args.report}.json and .md")


def _markdown(r: dict) -> str:
    o, m, rss = r["overhead"], r["machine"], r["driver_rss_mb"]
    gap, outside = o["gap_between_shards_ms"], o["in_shard_outside_decoding_ms"]
    statuses = r["status_during_job"] + [{"at_seconds": "end", **r["status_at_end"]}]
    lines = [
        f"# A corpus of {r['totals']['rows_in']:,} rows in {r['corpus']['shards']:,} shards (tiny pair)",
        "",
        f"`{r['command']}` at commit {r['commit'][:7]}{' (dirty)' if r['dirty'] else ''}; "
        f"{m['cpu_model']}, {m['cores']} cores, AVX2 {m['avx2']}, AVX-512 BF16 {m['avx512_bf16']}; "
        "two 1-CPU model actors, float32, batch 50, target-only (drafter none: the decoding is not "
        "what is measured, so the cheapest); submitted "
        "through the Jobs API of a local `ray start --head`.",
        "",
        f"- job {r['job']['state']} in {r['job']['wall_seconds']} s (models loaded, duplicates settled, "
        f"shards decoded), `_SUCCESS` {r['complete']}: "
        f"{r['totals']['rows_out']:,} rows out, {r['totals']['rows_error']} in errors/, "
        f"{r['totals']['tokens_out']:,} tokens",
        f"- driver RSS: peak {rss['peak']} MB, last {rss['last']} MB "
        f"({rss['samples']} samples, one a second; by minute: {rss['by_minute']})",
        f"- between one shard's end and the next one's start on an actor: median "
        f"{gap['median']} ms, p95 {gap['p95']} ms",
        f"- in a shard, outside decoding and the speedup sample (read, prompts, write outputs, errors, "
        "stats): median "
        f"{outside['median']} ms, p95 {outside['p95']} ms",
        f"- from the first shard's start to the last one's end, {o['shard_phase_seconds']} s: actors idle "
        f"{o['idle_ms_per_shard']} ms per shard (decoding {o['decode_seconds_total']} s, actors in shards "
        f"{o['actor_busy_seconds_total']} s in all)",
        f"- `pipeline stats` on the output: {r['stats_command_seconds']} s; manifest.json "
        f"{r['manifest_bytes']:,} bytes",
        "",
        "| `pipeline status` at | shards done | `job_status` call | whole command |",
        "|---|---|---|---|",
        *[
            f"| {s['at_seconds']} s | {s['shards_done']} | {s['call_seconds']} s | {s['command_seconds']} s |"
            for s in statuses
        ],
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
