"""The progress line of the data phases (data/progress.py) and of tools/preprocess_data.py."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

from multiproc import REPO

from data.progress import Progress, format_duration, track


def test_format_duration():
    assert format_duration(0) == "0:00"
    assert format_duration(62.4) == "1:02"
    assert format_duration(3723) == "1:02:03"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_whole_lines_and_the_last_one_has_the_total():
    out = io.StringIO()
    items = list(track(range(5), "tokenizing", total=5, stream=out, size=lambda _: 1000))
    assert items == list(range(5))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 1  # only the final line within 10 s
    pattern = r"tokenizing: 5/5 docs \(100%\) \| \d+ docs/s, [\d.]+ MB/s \| elapsed"
    assert re.match(pattern, lines[0])


def test_a_terminal_line_is_rewritten_in_place_with_an_eta():
    out = _Terminal()
    progress = Progress("packing", total=10, unit="images", stream=out, every=0.0)
    for _ in range(4):
        progress.update()
    text = out.getvalue()
    assert text.count("\r") == 4 and "\n" not in text
    assert "4/10 images (40%)" in text and "ETA" in text
    progress.close()
    assert out.getvalue().endswith("\n") and "ETA" not in out.getvalue().split("\r")[-1]


def test_preprocess_data_reports_progress_on_stderr(tmp_path):
    src = tmp_path / "in.jsonl"
    texts = [f"def f{i}(x):\n    return x + {i}\n" * 20 for i in range(40)]
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools/preprocess_data.py"), "--input", str(src),
         "--vocab-size", "300", "--output-prefix", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"tokenizing text: 40/40 docs \(100%\) \| \d+ docs/s", proc.stderr)
    assert "data_prefix:" in proc.stdout
