"""The folders the README tells a user to write (tools' ``--output``, a downloaded Hugging
Face model's ``--input hf/...``, run directories) are ignored by git, so a user following
it never sees models and checkpoints offered for a commit."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.multiproc import REPO

# A relative path after an option or key that names where files are written or kept.
_WRITES = re.compile(
    r"(?:(?:--output|--out|--input)[ =]|(?:logging|checkpoint)\.dir=)([A-Za-z0-9_.][\w./-]*)"
)


def _suggested() -> set[str]:
    text = (REPO / "README.md").read_text()
    found = {m.group(1).rstrip(".,`") for m in _WRITES.finditer(text)}
    # Left out: the user's own sources (a corpus file) and placeholders (DIR).
    return {p for p in found if not p.endswith((".jsonl", ".txt")) and not p.isupper()}


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout"
)
def test_every_folder_the_readme_writes_to_is_ignored():
    paths = _suggested()
    assert {"exported/gpt_tiny", "converted/gpt_tp4", "hf/llama", "runs/bf16"} <= paths
    for path in sorted(paths):
        probe = f"{path}/model.safetensors"
        done = subprocess.run(["git", "check-ignore", "-q", probe], cwd=REPO, check=False)
        assert done.returncode == 0, f"{probe} is not ignored by .gitignore"
