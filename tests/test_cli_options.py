"""`llmdb` options: values a command would misread are refused at parsing, naming the flag;
`calibrate --output` is checked before any timing; remote models are named as such where a
local engine is needed; the cost model's hint is a calibrate command that writes the file the
engine reads; `python -m llmdb` runs the command."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from llmdb import cli
from llmdb.cli import main
from llmdb.engine import engine as engine_module
from llmdb.engine.costmodel import CostModelKey, calibrate_command, engine_cost_model
from llmdb.engine.research import calibrate as cal


@pytest.fixture
def no_engine(monkeypatch):
    """Building an engine (the minutes of work before a calibration's write) fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(engine_module, "LLMEngine", refuse)


@pytest.fixture
def no_command(monkeypatch):
    """The subcommands themselves fail the test: only parsing may answer."""
    def refuse(args):
        raise AssertionError(f"{args.command} ran")

    for name in ("_sql", "_explain", "_calibrate", "_serve"):
        monkeypatch.setattr(cli, name, refuse)


def _capture(monkeypatch, name: str) -> list:
    """The parsed arguments each call of subcommand `name` gets; it does nothing else."""
    calls = []
    monkeypatch.setattr(cli, name, lambda args: calls.append(args) or 0)
    return calls


def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_calibrate_refuses_a_directory_or_an_unwritable_output_before_any_work(
        tmp_path, capsys, no_engine):
    (tmp_path / "out").mkdir()
    (tmp_path / "file").write_text("x")
    before = sorted(tmp_path.rglob("*"))
    err = _usage_error(["calibrate", "--quick", "--output", str(tmp_path / "out")], capsys)
    assert "argument --output" in err and "is a directory" in err
    err = _usage_error(["calibrate", "--output", str(tmp_path / "file" / "sub" / "c.json")],
                       capsys)
    assert "argument --output" in err and "is a file, not a directory" in err
    assert sorted(tmp_path.rglob("*")) == before  # no stray DIR.tmp, nothing made


def test_calibrate_function_checks_output_and_passes_before_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(cal, "load_engine", lambda *a, **k: pytest.fail("engine loaded"))
    with pytest.raises(ValueError, match="is a directory"):
        cal.calibrate(quick=True, path=tmp_path)
    for passes in (0, -1):
        with pytest.raises(ValueError, match=f"at least 1 timed pass, not {passes}"):
            cal.calibrate(quick=True, passes=passes)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", [
    ["calibrate", "--passes", "0"],
    ["calibrate", "--passes", "-1"],
    ["calibrate", "--threads", "0"],
    ["serve", "--max-concurrent", "0"],
    ["serve", "--max-prompt-tokens", "0"],
    ["serve", "--max-prompt-tokens", "-5"],
    ["serve", "--max-body-bytes", "-1"],
    ["serve", "--max-tokens", "0"],
    ["serve", "--threads", "-3"],
    ["serve", "--max-context", "0"],
    ["sql", "SELECT 1", "--max-context", "-1"],
    ["serve", "--port", "99999"],
    ["serve", "--port", "-1"],
    ["serve", "--shutdown-timeout", "-1"],
    ["serve", "--shutdown-timeout", "nan"],
    ["sql", "SELECT 1", "--max-rows", "0"],
    ["sql", "SELECT 1", "--sample-rows", "-2"],
    ["explain", "SELECT 1", "--sample-rows", "0"],
])
def test_numeric_flags_are_refused_at_parsing_naming_the_flag(argv, capsys, no_command):
    flag, value = argv[-2:]
    err = _usage_error(argv, capsys)
    assert f"argument {flag}: must be" in err and value in err


def test_documented_values_and_defaults_still_parse(monkeypatch):
    serves, calibrations = _capture(monkeypatch, "_serve"), _capture(monkeypatch, "_calibrate")
    assert main(["serve"]) == 0
    assert main(["serve", "--port", "0", "--shutdown-timeout", "0", "--dtype", "fp32",
                 "--threads", "1", "--max-prompt-tokens", "1"]) == 0
    default, chosen = serves
    assert (default.port, default.max_prompt_tokens, default.threads, default.dtype) == \
        (8000, None, None, None)
    assert (chosen.port, chosen.shutdown_timeout, chosen.dtype, chosen.threads) == \
        (0, 0.0, "fp32", 1)
    assert main(["calibrate", "--passes", "1", "--dtype", "bf16", "--threads", "2"]) == 0
    (args,) = calibrations
    assert (args.passes, args.dtype, args.threads) == (1, "bf16", 2)


def test_max_context_reaches_the_engine_from_sql_and_serve(monkeypatch):
    """`--max-context N` is the engine's max_context: a longer prompt is refused naming the
    context served, where the model's own 8,192 would take it."""
    # (A process of its own: this one's smollm2 engine, if another test started it, would
    # refuse a second max_context.)
    query = "SELECT llm_complete(repeat('word ', 100)) AS a"
    done = subprocess.run([sys.executable, "-m", "llmdb", "sql", query, "--max-context", "64",
                           "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "131 tokens, longer than the context of 64 served" in done.stderr
    served = []
    monkeypatch.setattr("llmdb.server.run.serve", lambda *a, **options: served.append(options))
    assert main(["serve", "--no-auth", "--max-context", "4096"]) == 0
    assert served[0]["max_context"] == 4096


def test_a_remote_model_is_named_remote_where_a_local_engine_is_needed(
        tmp_path, monkeypatch, capsys, no_engine):
    from llmdb.backends.remote_models import add_remote_model

    monkeypatch.setenv("LLMDB_CONFIG_DIR", str(tmp_path / "config"))
    add_remote_model("r3", ["http://127.0.0.1:9/v1"])
    for argv in (["serve", "--model", "r3", "--no-auth"], ["calibrate", "--model", "r3"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "'r3' is a remote model" in err and f"`llmdb {argv[0]}` runs a local" in err
        assert "unknown model" not in err


def test_python_dash_m_llmdb_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "llmdb", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: llmdb") and "calibrate" in done.stdout


def test_the_hint_of_a_gpu_key_parses_as_a_calibrate_command(monkeypatch):
    key = CostModelKey("llama-7b@0123456789ab", "fp16", "cuda:NVIDIA H100 80GB HBM3", 0)
    command = calibrate_command(key)
    assert command == "llmdb calibrate --model llama-7b --dtype fp16 --device cuda"
    calibrations = _capture(monkeypatch, "_calibrate")
    assert main(shlex.split(command)[1:]) == 0
    (args,) = calibrations
    assert (args.model, args.dtype, args.device, args.threads) == \
        ("llama-7b", "fp16", "cuda", None)


def test_the_hinted_calibrate_command_writes_the_file_that_engine_reads(
        tmp_path, monkeypatch, capsys):
    """An fp32 engine on one thread (`serve --dtype fp32 --threads 1`) is told to run a
    command; run, it calibrates that very key, so the next such engine reads the file.
    The steps are timed by a stand-in (the fit, the key and the write are real)."""
    import torch

    from llmdb.engine.engine import LLMEngine

    from .sql_support import isolated_cache_dir

    monkeypatch.setenv("LLMDB_CACHE_DIR", str(isolated_cache_dir(tmp_path / "cache")))
    # Torch work on this thread gives it a thread count of its own (the cores'), which the
    # key must not take for the engine's.
    torch.ones(256, 256) @ torch.ones(256, 256)
    options = {"device": "cpu", "dtype": "fp32", "threads": 1, "kv_cache_bytes": 16 << 20}
    hint = LLMEngine(**options).cost_model.source
    assert not hint.startswith("calibrated")
    command = re.search(r"`(llmdb calibrate [^`]*)`", hint)[1]
    assert "--dtype fp32" in command and "--threads 1" in command

    monkeypatch.setattr(cal.StepTimer, "run", lambda self, scheduled: 0.01 + 1e-4 * sum(
        tokens for _, tokens in scheduled))
    monkeypatch.setattr(cal, "_others_were_busy", lambda *a: False)
    assert main(shlex.split(command)[1:] + ["--quick", "--passes", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    engine = LLMEngine(**options)
    assert engine.cost_model.source.startswith("calibrated ")
    assert engine_cost_model(engine).source == engine.cost_model.source


def test_batch_invariant_reaches_the_engine_from_sql_and_serve(monkeypatch):
    import llmdb
    from llmdb.server import run

    seen = []

    def connect(*args, **options):
        seen.append(options)
        raise RuntimeError("stop here")

    monkeypatch.setattr(llmdb, "connect", connect)
    with pytest.raises(RuntimeError, match="stop here"):
        main(["sql", "--batch-invariant", "--no-progress", "SELECT 1"])
    assert seen[-1]["batch_invariant"] is True
    with pytest.raises(RuntimeError, match="stop here"):
        main(["sql", "--no-progress", "SELECT 1"])
    assert "batch_invariant" not in seen[-1]

    monkeypatch.setattr(run, "serve", lambda *args, **engine_options: seen.append(engine_options))
    for argv, want in ((["serve", "--no-auth", "--batch-invariant"], True),
                       (["serve", "--no-auth"], False)):
        assert main(argv) == 0
        assert seen[-1]["batch_invariant"] is want
