"""README's "Which level to use" table says what docs/BENCHMARKS.md measured: the H200 speed
and peak-memory ratios of GPT-1.3B per level against bf16, and the tiny GPT's validation loss
against bf16 across seeds. When a benchmark is rerun (the GPU speed work, new seeds), this
fails until the README's table is brought up to date with it."""

from __future__ import annotations

import re

from tests.multiproc import REPO


def _section(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


def _rows(markdown: str) -> list[list[str]]:
    """The cells of each row of the markdown tables in ``markdown`` (header rows included)."""
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in markdown.splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]


def _readme_table() -> dict[str, list[str]]:
    readme = (REPO / "README.md").read_text()
    part = _section(readme, "### Which level to use", "\n### ")
    return {row[0]: row for row in _rows(part)}


def test_readme_level_table_has_the_measured_gpu_ratios():
    bench = (REPO / "docs" / "BENCHMARKS.md").read_text()
    gpu = _rows(_section(bench, "<!-- bench_gpu:levels:1.3b:begin -->", "end -->"))
    head = gpu[0]
    speed_col, memory_col = head.index("speed vs fp8train bf16"), head.index("peak memory GiB")
    measured = {r[0].removeprefix("fp8train "): r for r in gpu[1:] if r[0].startswith("fp8train")}
    bf16_peak = float(measured["bf16"][memory_col])
    table = _readme_table()
    for name, row in measured.items():
        level = name.split(":")[0]
        speed = row[speed_col]
        memory = f"{float(row[memory_col]) / bf16_peak:.2f}x"
        if name == "bf16":
            assert table["bf16"][2:4] == [memory, speed], table["bf16"]
            continue
        assert f"{name} {memory}" in table[level][2], (name, memory, table[level])
        assert f"{name} {speed}" in table[level][3], (name, speed, table[level])


def test_readme_level_table_has_the_measured_fidelity_across_seeds():
    bench = (REPO / "docs" / "BENCHMARKS.md").read_text()
    # The per-tensor levels at three seeds with today's O3 (its master from the initial value).
    begin = "<!-- bench_levels:gpt_tensor_o3_master:begin -->"
    seeds = _rows(_section(bench, begin, "end -->"))
    col = seeds[0].index("valid vs bf16: mean [min, max]")
    table = _readme_table()
    for row in seeds[1:]:
        if row[0] == "bf16":
            continue
        assert table[row[0]][4] == row[col], (row[0], table[row[0]])


def test_readme_says_the_fp8_levels_are_slower_on_the_gpu():
    readme = (REPO / "README.md").read_text()
    part = _section(readme, "### Which level to use", "\n### ")
    assert re.search(r"slower than bf16 on the H200", part)
