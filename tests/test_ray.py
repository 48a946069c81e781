"""llmdb.ray: the row functions over a Ray Dataset on engine actors (a local Ray, 2 workers).

Answers equal the single-process DataFrame call's (fp32 greedy); a worker killed mid-job is
restarted by Ray, the job loses no row and duplicates none, and the retried batch is served
from the result cache: every row is computed by the model exactly once. Failed rows: under
on_error='null' error_column brings each one's error to the driver, as the single-process
call gives it; under 'raise' the driver gets llmdb.LLMError naming the row and the cause.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'llmdb[ray]')")

import llmdb  # noqa: E402
import llmdb.ray  # noqa: E402
from llmdb.engine.compute import run_on_compute_thread  # noqa: E402

from .sql_support import isolated_cache_dir  # noqa: E402

# The process's own engine runs in fp32 (tests/sql_support.start_engine); the workers' match.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("eng")]
OPTIONS = {"dtype": "fp32", "max_tokens": 4}
# Two batches of BATCH rows: one for each of two workers, the second holding "Donald" (whose
# worker DiesOnce kills). Each row is a prefill in every run, so no more rows than that.
NAMES = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald"]
BATCH = 3


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    cache = isolated_cache_dir(tmp_path_factory.mktemp("ray-cache"))
    # Workers inherit these: the CPU engine, and the kernels the tests already built. Set in
    # the environment Ray's processes start in (not as a runtime_env, which costs each
    # worker pool 2-4 s to set up), and only while they start.
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"LLMDB_CACHE_DIR": str(cache), "LLMDB_DEVICE": "cpu"}.items():
            env.setenv(name, value)
        # Ray sets OMP_NUM_THREADS to each worker's CPUs, one here, only where the driver has
        # not set it; the workers' engines are to take that.
        env.delenv("OMP_NUM_THREADS", raising=False)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    # The test's RowMapper subclass travels by value: workers cannot import tests/.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


def _rows() -> pa.Table:
    return pa.table({"id": list(range(len(NAMES))), "name": NAMES})


@functools.cache  # one in-process run answers every test that compares with it
def _expected() -> dict[int, str]:
    out = llmdb.complete(_rows(), "Write a one-line greeting for {name}.", cache=False,
                         **OPTIONS)
    return dict(zip(out.column("id").to_pylist(), out.column("completion").to_pylist(),
                    strict=True))


class Records(llmdb.ray.RowMapper):
    """Logs each batch to a file: its names, the rows the model computed and the cache
    answered, the worker's process and its engine's compute threads."""

    log_dir: str = ""

    def __call__(self, batch: pa.Table) -> pa.Table:
        before = self.session.total.model_rows, self.session.total.cache_hits
        out = super().__call__(batch)
        names = batch.column("name").to_pylist()
        self.log({"names": names, "model_rows": self.session.total.model_rows - before[0],
                  "cache_hits": self.session.total.cache_hits - before[1], "pid": os.getpid(),
                  "threads": run_on_compute_thread(torch.get_num_threads)}, names)
        return out

    def log(self, record: dict, names: list[str]) -> None:
        with open(Path(self.log_dir) / "batches.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def test_map_rows_equals_the_in_process_call(local_ray, tmp_path):
    Records.log_dir = str(tmp_path)
    # The default batch of 256 rows: the six are shared out, three a worker.
    out = llmdb.ray.map_rows(_rows(), "complete", "Write a one-line greeting for {name}.",
                             num_workers=2, cache_path=str(tmp_path / "r.sqlite"),
                             mapper=Records, **OPTIONS)
    table = llmdb.ray.to_arrow(out)
    batches = [json.loads(line) for line in open(tmp_path / "batches.jsonl")]
    assert sorted(len(b["names"]) for b in batches) == [BATCH, BATCH]
    assert len({b["pid"] for b in batches}) == 2, batches  # each worker took one
    assert {b["threads"] for b in batches} == {1}  # the one CPU Ray gave each worker
    assert table.column_names == ["id", "name", "completion"]  # no error column unless asked
    got = dict(zip(table.column("id").to_pylist(), table.column("completion").to_pylist(),
                   strict=True))
    assert got == _expected()
    # Back into DuckDB.
    con = llmdb.connect(cache=False)
    con.register("greetings", table)
    assert con.sql("SELECT count(*) FROM greetings").fetchall()[0][0] == len(NAMES)
    con.close()


class DiesOnce(Records):
    """Records each batch; the worker that computes the batch holding "Donald" dies
    (SIGKILL-like os._exit) the first time, after its rows are computed and cached and
    before Ray gets them."""

    def log(self, record: dict, names: list[str]) -> None:
        marker = Path(self.log_dir) / "died"
        dies = "Donald" in names and not marker.exists()
        super().log({**record, "died": dies}, names)
        if dies:
            marker.touch()
            os._exit(1)


def test_a_killed_worker_loses_no_row_and_recomputes_nothing(local_ray, tmp_path):
    DiesOnce.log_dir = str(tmp_path)
    out = llmdb.ray.map_rows(_rows(), "complete", "Write a one-line greeting for {name}.",
                             num_workers=2, batch_size=BATCH, mapper=DiesOnce,
                             cache_path=str(tmp_path / "r.sqlite"), **OPTIONS)
    table = llmdb.ray.to_arrow(out)
    assert sorted(table.column("id").to_pylist()) == list(range(len(NAMES)))  # none lost or twice
    got = dict(zip(table.column("id").to_pylist(), table.column("completion").to_pylist(),
                   strict=True))
    assert got == _expected()
    batches = [json.loads(line) for line in open(tmp_path / "batches.jsonl")]
    died = [b for b in batches if b["died"]]
    assert len(died) == 1, batches
    retried = [b for b in batches if b["names"] == died[0]["names"] and not b["died"]]
    assert len(retried) == 1 and retried[0]["model_rows"] == 0
    assert retried[0]["cache_hits"] == len(died[0]["names"])
    assert sum(b["model_rows"] for b in batches) == len(NAMES)  # each row computed once


def test_bad_arguments_fail_on_the_driver():
    with pytest.raises(ValueError, match="function must be one of"):
        llmdb.ray.map_rows(_rows(), "summarize", "{name}")
    with pytest.raises(TypeError, match="unknown llmdb option.*max_token"):
        llmdb.ray.map_rows(_rows(), "complete", "{name}", max_token=4)
    # A column the rows lack, as the same call in one process says it (no worker starts).
    for function, args, options in [("complete", ("Hi {nme}.",), {}),
                                    ("complete", ("Greet.",), {"fields": ["name", "age"]}),
                                    ("filter", (), {"template": "{nme}?"}),
                                    ("classify", ("nme", ["a", "b"]), {})]:
        with pytest.raises(KeyError, match=r"column\(s\) (nme|age) not in the table"):
            llmdb.ray.map_rows(_rows(), function, *args, **options)
        with pytest.raises(KeyError, match=r"column\(s\) (nme|age) not in the table"):
            getattr(llmdb, function)(_rows(), *args, **options)



@pytest.mark.parametrize("function,args,options", [
    ("complete", ("Greet {name}.",), {"max_tokens": 0}),
    ("complete", ("Greet {name}.",), {"temperature": -1}),
    ("complete", ("Greet {name}.",), {"on_error": "sometimes"}),
    ("complete", ("Greet {name}.",), {"error_column": "completion"}),
    ("complete", ("Greet {name}.",), {"output": "name"}),  # a column of the rows
    ("filter", ("{name}?",), {"error_column": "id"}),
    ("complete", ("Greet.",), {"reorder_fields": True}),
    ("filter", ("{name}?",), {"error_column": ""}),
    ("classify", ("name", ["a", "a"]), {}),
    ("classify", ("name", "ab"), {}),
    ("complete", ("Greet {name}.",), {"max_tokens": "4"}),
    ("complete", ("Greet {name}.",), {"model": 5}),  # (a model is not loaded to check it)
    ("classify", ("name", ["a", "b"]), {"instruction": 5})])
def test_a_wrong_option_fails_on_the_driver_as_in_one_process(function, args, options):
    """A wrong option of the call is the single-process call's error (type and message),
    raised by map_rows before any worker starts: in a worker it came back, after a model
    load, as Ray's RayTaskError(UserCodeException), a traceback of 27 lines."""
    with pytest.raises((ValueError, TypeError)) as in_process:
        getattr(llmdb, function)(_rows(), *args, cache=False, **options)
    with pytest.raises(type(in_process.value)) as got:
        llmdb.ray.map_rows(_rows(), function, *args, **options)
    assert str(got.value) == str(in_process.value)



def test_a_column_missing_from_a_dataset_of_unknown_schema_is_llmdbs_error(local_ray):
    """A dataset whose schema is known only once it runs: a worker finds the column it
    lacks, and to_arrow raises the single-process call's KeyError, not Ray's wrapper."""
    rows = ray.data.from_arrow(_rows()).map_batches(lambda b: b, batch_format="pyarrow")
    assert rows.schema(fetch_if_missing=False) is None  # (else map_rows finds it)
    with pytest.raises(KeyError) as in_process:
        llmdb.complete(_rows(), "Hi {nme}.")
    out = llmdb.ray.map_rows(rows, "complete", "Hi {nme}.", **OPTIONS)
    with pytest.raises(KeyError) as got:
        llmdb.ray.to_arrow(out)
    assert type(got.value) is KeyError and str(got.value) == str(in_process.value)


def test_a_column_taken_in_a_dataset_of_unknown_schema_is_llmdbs_error(local_ray):
    """Rows that already have the column the call adds, where map_rows cannot see it: the
    first batch fails with the single-process call's ValueError naming the column, not
    Ray's "UDF failed to process a data block"."""
    taken = _rows().append_column("completion", pa.array(["mine"] * len(NAMES)))
    rows = ray.data.from_arrow(taken).map_batches(lambda b: b, batch_format="pyarrow")
    assert rows.schema(fetch_if_missing=False) is None
    with pytest.raises(ValueError) as in_process:
        llmdb.complete(taken, "Hi {name}.")
    out = llmdb.ray.map_rows(rows, "complete", "Hi {name}.", **OPTIONS)
    with pytest.raises(ValueError) as got:
        llmdb.ray.to_arrow(out)
    assert type(got.value) is ValueError and str(got.value) == str(in_process.value)
    assert "already has a column 'completion': output='completion'" in str(got.value)


@pytest.mark.parametrize("function,args,options,taken", [
    ("complete", ("Hi {name}.",), {}, "completion"),  # the default output
    ("complete", ("Hi {name}.", "id"), {}, "id"),  # output given by position
    ("classify", ("name", ["a", "b"]), {}, "label"),
    ("filter", ("{name}?",), {"error_column": "id"}, "id"),
    ("complete", ("Hi {name}.",), {"output": "out", "error_column": "name"}, "name")])
def test_a_worker_refuses_a_column_the_batch_has_already(function, args, options, taken):
    """The worker's own check (the batch function itself, no Ray): the single-process
    call's error, raised as it is to Ray (a UserCodeException, so that Ray does not wrap
    it)."""
    batch = _rows() if taken in _rows().column_names else _rows().append_column(
        taken, pa.array(["mine"] * len(NAMES)))
    with pytest.raises(ValueError) as in_process:
        getattr(llmdb, function)(batch, *args, cache=False, **options)
    mapper = llmdb.ray.RowMapper(function, args, {**OPTIONS, **options, "cache": False})
    with pytest.raises(ValueError) as got:
        mapper(batch)
    assert isinstance(got.value, ray.exceptions.UserCodeException)
    assert got.value.message == str(in_process.value)
    assert f"already has a column {taken!r}" in got.value.message


LONG = "word " * 9000  # longer than the model's context: the row fails at submit
TEMPLATE = "Write a one-line greeting for {name}."


def _rows_with_failures() -> pa.Table:
    names = list(NAMES)
    names[2] = names[4] = LONG  # the same failing call in two batches
    names[5] = "Also " + LONG
    return pa.table({"id": list(range(len(names))), "name": names})


def test_failed_rows_bring_their_error_to_the_driver(local_ray, tmp_path):
    """on_error='null' with error_column: the rows come back as the single-process call
    gives them, each failed row with its error; the workers' own error lists never reach
    the driver."""
    rows = _rows_with_failures()
    options = {**OPTIONS, "on_error": "null", "error_column": "error"}
    out = llmdb.ray.map_rows(rows, "complete", TEMPLATE, batch_size=BATCH,
                             cache_path=str(tmp_path / "r.sqlite"), **options)
    table = llmdb.ray.to_arrow(out).sort_by("id")
    expected = llmdb.complete(rows, TEMPLATE, cache=False, **options)
    assert table.to_pylist() == expected.to_pylist()
    errors = table.column("error").to_pylist()
    assert [i for i, e in enumerate(errors) if e is not None] == [2, 4, 5]
    assert errors[2].startswith("llm_complete failed on the row with prompt 'Write a one")
    assert "longer than the model's context" in errors[2]


def test_a_worker_without_error_column_says_rows_failed(caplog):
    """Without error_column the failed rows' errors stay in the worker: its log (which Ray
    shows on the driver) says so once, with one of them, and how to keep them."""
    rows = _rows_with_failures().slice(1, 2)  # a good row, then a failed one
    mapper = llmdb.ray.RowMapper("complete", (TEMPLATE,),
                                 {**OPTIONS, "on_error": "null", "cache": False})
    with caplog.at_level(logging.WARNING, logger="llmdb.ray"):
        out = mapper(rows)
        mapper(rows)
    assert out.column("completion").to_pylist()[1] is None
    [warning] = caplog.records
    assert "1 row(s) of a batch failed under on_error='null'" in warning.getMessage()
    assert mapper.session.errors[-1].error in warning.getMessage()
    assert "error_column='error'" in warning.getMessage()
    caplog.clear()
    with_column = llmdb.ray.RowMapper("complete", (TEMPLATE,), {
        **OPTIONS, "on_error": "null", "cache": False, "error_column": "error"})
    with caplog.at_level(logging.WARNING, logger="llmdb.ray"):
        with_column(rows)
    assert not caplog.records


def test_a_failed_row_under_raise_is_llmdbs_error_on_the_driver(local_ray, tmp_path):
    """to_arrow raises the error the single-process call raises: llmdb.LLMError naming the
    row's prompt and the cause. Ray's own consumers (write_parquet here) raise Ray's error,
    which is an llmdb.LLMError too, reported by Ray as the user's, with llmdb's message."""
    rows = _rows_with_failures().slice(1, 2)  # a good batch, then a failed one
    with pytest.raises(llmdb.LLMError) as in_process:
        llmdb.complete(rows, TEMPLATE, cache=False, **OPTIONS)
    out = llmdb.ray.map_rows(rows, "complete", TEMPLATE, batch_size=1,
                             cache_path=str(tmp_path / "r.sqlite"), **OPTIONS)
    with pytest.raises(llmdb.LLMError) as got:
        llmdb.ray.to_arrow(out)
    assert type(got.value) is llmdb.LLMError
    assert str(got.value) == str(in_process.value)
    assert "longer than the model's context" in str(got.value)
    with pytest.raises(llmdb.LLMError) as ray_own:
        out.write_parquet(str(tmp_path / "out"))
    assert isinstance(ray_own.value, ray.exceptions.RayTaskError)
    assert isinstance(ray_own.value, ray.exceptions.UserCodeException)
    assert str(in_process.value) in str(ray_own.value)


def test_few_rows_are_shared_out_one_block_a_worker(local_ray):
    def spread(rows, workers=2, batch=256):
        dataset, batch = llmdb.ray._spread(rows, workers, batch)
        return dataset.num_blocks(), batch

    table = pa.table({"n": list(range(64))})
    assert spread(table) == (2, 32)
    assert spread(table, workers=3) == (3, 22)
    # from_query's one block of 64 rows (Ray knows its count) is cut before the workers start.
    con = llmdb.connect(cache=False)
    con.register("t", table)
    assert spread(llmdb.ray.from_query(con, "SELECT n FROM t")) == (2, 32)
    # Enough rows for full batches: as given.
    assert spread(pa.table({"n": list(range(600))})) == (3, 256)
    # A dataset whose count Ray would have to compute: its blocks as given.
    lazy = ray.data.from_arrow(table).map_batches(lambda b: b, batch_format="pyarrow")
    dataset, batch = llmdb.ray._spread(lazy, 2, 256)
    assert dataset is lazy and batch == 256
