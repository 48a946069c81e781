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
