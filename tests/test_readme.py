"""Every Python block of the README runs as written, each in a fresh process (the bundled
model on the CPU, a result cache of its own)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .sql_support import child_env

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)

pytestmark = pytest.mark.slow


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs_as_written(code, tmp_path):
    if "import ray" in code:
        pytest.importorskip("ray", reason="Ray is not installed (pip install 'llmdb[ray]')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=child_env(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-3000:]
