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


class ShardProgress:
    def __init__(self, total: int, show_bar: bool):
        self.total = total
        self.finished = 0
        self.rows = self.errors = self.tokens = self.drafted = self.accepted = 0
        self.began = time.monotonic()
        self.bar = tqdm(total=total, unit="shard", dynamic_ncols=True, file=sys.stderr) if show_bar else None

    def note(self, line: str) -> None:
        """A message (a retry, a failure) that must not tear the bar."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def shard_done(self, stats: dict) -> None:
        self.finished += 1
        self.rows += stats.get("rows_out", 0)
        self.errors += stats.get("rows_error", 0)
        self.tokens += stats.get("tokens_out", 0)
        self.drafted += stats.get("drafted", 0)
        self.accepted += stats.get("accepted", 0)
        figures = self._figures()
        if self.bar is not None:
            self.bar.set_postfix_str(figures, refresh=False)
            self.bar.update(1)
            return
        status = stats.get("status", "ok")
        what = "" if status == "ok" else f" ({status})"
        line = f"[{self.finished}/{self.total}] shard {stats.get('shard')} done{what}; job so far: {figures}"
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
        alpha = f"{self.accepted / self.drafted:.2f}" if self.drafted else "-"
        return (
            f"rows {self.rows} (+{self.errors} err), tokens {self.tokens}, "
            f"{self.tokens / elapsed if elapsed > 0 else 0:.1f} tok/s since start, α {alpha}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
