"""A progress line for the long data phases (tokenizer training aside, they are loops over
documents): count, rate, elapsed time and ETA, on stderr.

On a terminal the line is rewritten in place at most a few times a second; in a log file or
CI (no terminal) a new line is printed every ``every`` seconds instead, so the log shows the
job is alive without a line per document. The last line is always printed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO, TypeVar

__all__ = ["Progress", "format_duration", "track"]

T = TypeVar("T")


def format_duration(seconds: float) -> str:
    """``1:02:03`` / ``2:03`` (hours only when there are any)."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """``what``: the phase ("tokenizing"); ``total``: items expected (None: unknown, no ETA);
    ``unit``: what an item is ("docs"). ``update(n, nbytes)`` after each batch of items."""

    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "docs",
        stream: TextIO | None = None,
        every: float | None = None,
    ):
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else (0.2 if self.live else 10.0)
        self.count = self.nbytes = 0
        self.start = self.last = time.perf_counter()
        self.closed = False

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        rate = self.count / elapsed
        done = f"{self.count}"
        if self.total:
            done += f"/{self.total} {self.unit} ({100 * self.count / self.total:.0f}%)"
        else:
            done += f" {self.unit}"
        parts = [f"{self.what}: {done}", f"{rate:.0f} {self.unit}/s"]
        if self.nbytes:
            parts[-1] += f", {self.nbytes / elapsed / 1e6:.1f} MB/s"
        parts.append(f"elapsed {format_duration(elapsed)}")
        if self.total and self.count and not self.closed:
            parts.append(f"ETA {format_duration((self.total - self.count) / rate)}")
        return " | ".join(parts)

    def _emit(self) -> None:
        end = "" if self.live and not self.closed else "\n"
        prefix = "\r\033[K" if self.live else ""
        self.stream.write(prefix + self.line() + end)
        self.stream.flush()

    def update(self, n: int = 1, nbytes: int = 0) -> None:
        self.count += n
        self.nbytes += nbytes
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self._emit()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._emit()

    def clear(self) -> None:
        """Stop without a last line, where another line follows at once (the next phase's
        progress, or a failure's one-line message): on a terminal the line in place is
        erased, in a log nothing more is printed."""
        if not self.closed:
            self.closed = True
            if self.live:
                self.stream.write("\r\033[K")
                self.stream.flush()


def track(
    items: Iterable[T],
    what: str,
    total: int | None = None,
    unit: str = "docs",
    size=None,
    stream: TextIO | None = None,
) -> Iterator[T]:
    """``items``, reporting progress as they are consumed (``size(item)``: its bytes, for a
    MB/s figure); the final line when they run out."""
    progress = Progress(what, total, unit, stream)
    for item in items:
        yield item
        progress.update(1, size(item) if size else 0)
    progress.close()
