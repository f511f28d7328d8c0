"""Decisions inside one device call of tools/gpu_call.sh, from the JSON its phases wrote.

    python3 -m benchmarks.gpu_call_plan check CHECK.json...           # summary; then the plan lines
    python3 -m benchmarks.gpu_call_plan rest LEVELS.json... ROW...    # the ROWs still to run

check: the compile check ran each level's compiled row (and one eager row built on the device)
at the 1.3B width with 2 layers, all at once. It prints one line per row (status, dynamo graphs
and breaks, kernels per step, first step), then the decisions as ``KEY value`` lines for the
shell: ``DROP LEVEL+compile`` for each compiled row that failed (its 24-layer row would fail
the same way after minutes of compilation), and ``BUILD_ON_DEVICE 1`` or ``0`` (whether the
eager row built on the device ran; 1 when no such row came back).

rest: the ROWs that no saved levels run (the arguments ending in ``.json``: the earlier calls
on this machine) ran to the end (no row, "not run: out of time", "failed: timed out ..."), in
the order given; rows that ran, or failed for a reason of their own, in any of the runs are
not run again. With no saved run (a fresh machine), every ROW.

Nothing here touches the device: it reads JSON and prints.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu import row_token  # noqa: E402

__all__ = ["check", "main", "rest"]


def _rows(path: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        return []
    data = json.loads(file.read_text())
    return data.get("rows") or data.get("rows_so_far", [])


def _describe(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['name']}: {row['status']}"
    graphs = f", graphs {row['graphs']} (breaks {row['graph_breaks']})" if "graphs" in row else ""
    kernels = row.get("kernels_per_step")
    per_step = f", {kernels:.0f} kernels/step" if kernels is not None else ""
    first = (row.get("warmup_s") or [0.0])[0]
    return (
        f"{row['name']}: ok{graphs}{per_step}, first step {first:.1f} s, "
        f"{row['step_s'] * 1e3:.1f} ms/step (rows ran at once: not a timing)"
    )


def check(paths: list[str]) -> list[str]:
    """The summary lines, then the decisions (``DROP ...``, ``BUILD_ON_DEVICE ...``)."""
    rows = [r for p in paths for r in _rows(p)]
    lines = [_describe(r) for r in rows]
    if not rows:
        lines.append("no check row came back")
    for r in rows:
        if r.get("compile") and r["status"] != "ok" and "timed out" not in r["status"]:
            lines.append(f"DROP {row_token(r)}")
    eager = [r for r in rows if not r.get("compile") and r.get("build_on_device")]
    works = not eager or any(r["status"] == "ok" for r in eager)
    lines.append(f"BUILD_ON_DEVICE {int(works)}")
    return lines


def _unfinished(status: str) -> bool:
    return status.startswith("not run") or "timed out" in status


def rest(paths: str | list[str], tokens: list[str]) -> list[str]:
    """The tokens whose rows did not run to the end in any of the runs saved at ``paths``."""
    paths = [paths] if isinstance(paths, str) else paths
    done = {row_token(r) for p in paths for r in _rows(p) if not _unfinished(r["status"])}
    return [t for t in tokens if t not in done]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("check", "rest"):
        raise SystemExit(__doc__)
    if argv[0] == "check":
        print("\n".join(check(argv[1:])))
    else:
        paths = [a for a in argv[1:] if a.endswith(".json")]
        print(" ".join(rest(paths, [a for a in argv[1:] if not a.endswith(".json")])))


if __name__ == "__main__":
    main()
