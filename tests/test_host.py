"""The host as llmdb sees it (kernels/host.py): one cache directory and one CPU reading for
the kernels' builds, the models' caches, the cost model's calibrations and the result cache."""

from __future__ import annotations

from pathlib import Path

import platformdirs
import pytest

from llmdb.engine.costmodel import cost_model_path
from llmdb.kernels.host import cache_dir, cpu_info


def test_caches_live_under_llmdb_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path
    assert cost_model_path().parent == tmp_path
    monkeypatch.delenv("LLMDB_CACHE_DIR")
    assert cache_dir() == Path(platformdirs.user_cache_dir("llmdb"))


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="/proc/cpuinfo is Linux's")
def test_cpu_info_is_the_first_processors_entry():
    first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    info = cpu_info()
    assert info.flags and all(f in first for f in info.flags)
    assert info.model in first
