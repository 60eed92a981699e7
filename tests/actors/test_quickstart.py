"""The README's snippet, exactly as the README shows it, run as a user runs it: a fresh
process, no ray.init of its own, no RAY_ADDRESS."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_snippet() -> str:
    """The first ```python block of the README's "Use it" section."""
    text = README.read_text()
    section = text[text.index("## Use it"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_snippet_is_the_public_api():
    snippet = readme_snippet()
    for call in ("start(", "connect(", ".put(", ".lookup(", ".get(", ".prefetch(", ".flush(",
                 ".stats("):
        assert call in snippet


def test_readme_snippet_runs_on_a_fresh_local_ray():
    disk_dir = tempfile.mkdtemp(prefix="raykv-quickstart-", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAYKV_DISK_DIR"] = disk_dir  # the default disk dir, pointed at a temp dir
    try:
        result = subprocess.run([sys.executable, "-c", readme_snippet()], capture_output=True,
                                text=True, timeout=300, env=env)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "'host': 6" in result.stdout or "'device': 6" in result.stdout, result.stdout
