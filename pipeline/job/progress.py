"""What `pipeline run` shows while a job runs: one bar over shards on a terminal, one line per
finished shard otherwise (a log file or a CI console keeps a readable record, not a bar's
carriage returns).

Both show the same running figures: rows and tokens done, tokens/s over the job's wall time,
α so far (accepted / drafted over every finished shard) and, on the bar, the ETA in shards.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

from pipeline.decode.stats import BatchStats
from pipeline.job.stats import ShardStats


class ShardProgress:
    def __init__(self, total: int, show_bar: bool):
        self.total = total
        self.finished = 0
        self.rows = self.errors = 0
        self.decoded = BatchStats()  # every finished shard's counters, added
        self.began = time.monotonic()
        self.bar = tqdm(total=total, unit="shard", dynamic_ncols=True, file=sys.stderr) if show_bar else None

    def note(self, line: str) -> None:
        """A message (a retry, a failure) that must not tear the bar."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def shard_done(self, record: dict) -> None:
        """A shard's stats file (`pipeline.job.stats`) is in: count it and show the figures."""
        stats = ShardStats.from_json(record)
        self.finished += 1
        self.rows += stats.rows_out
        self.errors += stats.rows_error
        if stats.ok:
            self.decoded.add(stats.decoded)
        figures = self._figures()
        if self.bar is not None:
            self.bar.set_postfix_str(figures, refresh=False)
            self.bar.update(1)
            return
        what = "" if stats.ok else f" ({stats.status})"
        line = f"[{self.finished}/{self.total}] shard {stats.shard} done{what}; job so far: {figures}"
        print(line, file=sys.stderr, flush=True)

    def shard_failed(self, line: str) -> None:
        self.finished += 1
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        else:
            print(f"[{self.finished}/{self.total}] {line}", file=sys.stderr, flush=True)

    def _figures(self) -> str:
        elapsed = time.monotonic() - self.began
        alpha = "-" if self.decoded.alpha is None else f"{self.decoded.alpha:.2f}"
        tokens = self.decoded.new_tokens
        return (
            f"rows {self.rows} (+{self.errors} err), tokens {tokens}, "
            f"{tokens / elapsed if elapsed > 0 else 0:.1f} tok/s since start, α {alpha}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
