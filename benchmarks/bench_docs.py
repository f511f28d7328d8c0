"""Shared by the benchmark scripts: put a block of generated text into docs/BENCHMARKS.md
(and a free local port for the gloo workers some of them start).

Each script owns a pair of HTML comment markers (``<!-- name:begin -->`` ...
``<!-- name:end -->``); only the text between them is rewritten, so the prose around a table
stays as people wrote it.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

__all__ = ["command_line", "free_port", "markers", "measured_with", "report", "write_section"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (for a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_line(launch: str, argv: list[str], environ=os.environ) -> str:
    """The command a table says it came from: ``launch`` and its arguments, with the switch of
    the CPU's kernels in front when it was set (it changes the rounding, and a
    bf16-against-itself control differs from the run it checks by that alone)."""
    switch = environ.get("ATEN_CPU_CAPABILITY")
    return " ".join([*([f"ATEN_CPU_CAPABILITY={switch}"] if switch else []), launch, *argv])


def measured_with(
    script: str, argv: list[str], elapsed: float, load_before: float, load_after: float
) -> str:
    """The opening of a CPU benchmark's text: date, cores, torch, the exact command, how long
    it ran and the machine's load around it (above 1: other jobs shared the cores)."""
    import torch

    command = command_line(f".venv/bin/python {script}", argv)
    shared = ": other jobs were using the cores" if max(load_before, load_after) > 1 else ""
    return (
        f"Measured {datetime.date.today().isoformat()} on {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}, with `{command}` ({elapsed:.0f} s; 1-minute load "
        f"average {load_before:.1f} before the run and {load_after:.1f} after it{shared})"
    )


def markers(tag: str) -> tuple[str, str]:
    """The begin and end markers of block ``tag``."""
    return f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"


def write_section(doc: Path, body: str, tag: str, heading: str | None = None) -> None:
    """Replace the block between ``tag``'s markers in ``doc``; if the document has none yet,
    append the block at the end (under ``heading`` when given). A missing document is started
    with a "# Benchmarks" title."""
    begin, end = markers(tag)
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        start, stop = text.index(begin), text.index(end) + len(end)
        text = text[:start] + block + text[stop:]
    elif heading:
        text = text.rstrip() + f"\n\n{heading}\n\n{block}\n"
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def report(
    text: str,
    write: str | None,
    tag: str,
    script: str,
    argv: list[str],
    started: float,
    load_before: float,
) -> None:
    """Print a benchmark's ``text``; with ``write`` (a markdown file) also put it there, in
    block ``tag``, after the ``measured_with`` opening. ``started``: ``time.monotonic()`` at
    the start; ``load_before``: the 1-minute load average then."""
    import time

    print(text)
    if write:
        opening = measured_with(
            script, argv, time.monotonic() - started, load_before, os.getloadavg()[0]
        )
        write_section(Path(write), f"{opening}.\n\n{text}", tag)
