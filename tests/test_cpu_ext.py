"""Loading the C++ kernels leaves the caller's floating-point mode alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .sql_support import child_env

CHECK = """
import sys
from llmdb.kernels import cpu_ext
tiny = float(sys.argv[1])  # the smallest subnormal double
if cpu_ext.load_library() is None:
    print("no compiler")
else:
    print(tiny * 1.0)  # 0.0 where flush-to-zero / denormals-are-zero got turned on
"""


def test_loading_the_kernels_keeps_subnormal_floats(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHECK, "5e-324"], capture_output=True,
                          text=True, timeout=600, env=child_env(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.strip() == "no compiler":
        pytest.skip("no C++ compiler: the kernels are not built here")
    assert done.stdout.strip() == "5e-324"


def test_a_failed_build_names_the_compilers_error(tmp_path, monkeypatch):
    from llmdb.kernels import cpu_ext

    fake = tmp_path / "fake-g++"
    fake.write_text('#!/bin/sh\necho "fake-g++: cannot build: $*" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))  # (nothing built there)
    monkeypatch.delenv("LLMDB_NO_CPP_KERNELS", raising=False)
    cpu_ext.load_library.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="building the C.. kernels failed") as err:
            cpu_ext.load_library()
    finally:
        cpu_ext.load_library.cache_clear()  # (the next caller loads the real build)
    # every source's error, not only the first to fail
    for source in cpu_ext.SOURCES:
        assert f"-c {source} -o" in str(err.value)
