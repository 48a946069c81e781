"""Run one batch of row calls: dedup, result cache, in-flight sharing, submission, waiting.

A Call is one row's work for an LLM function: one or more model requests (llm_classify asks
one per label) whose results `combine` into the row's value. Rows with the same key are
computed once: within the batch, across batches through the result cache, and across threads
and connections through the in-flight table (a second caller waits for the first). The
caller's thread waits in slices of at most 100 ms so that a cancelled query stops promptly.

A job that is killed resumes: each row's answer is cached as it completes, and the rows in
flight save the tokens they have generated (every CHECKPOINT_EVERY_S, and at once when the
query is cancelled or fails), which the rerun's requests go on from (resume_from). Without
that a rerun gained little: the engine runs a batch's rows together, so they finish together.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .backends import Backend, BackendResult, GenerationRequest, ModelRequest
from .session import QueryCancelled, Session, Stats

WAIT_SLICE_S = 0.1
PROGRESS_EVERY_S = 0.5  # how often rows in flight report their tokens to the progress bar
# How often rows in flight save their tokens so far: what a job killed outright (no chance to
# save them then) loses at most. A save reads a few hundred short lists and writes them in one
# SQLite transaction: 2-11 ms for 400 rows of 16-256 tokens.
CHECKPOINT_EVERY_S = 5.0


class LLMError(ValueError):
    """A row's call failed and the query asked for errors to be raised."""


@dataclass
class Call:
    requests: list[ModelRequest]
    key: str | None  # None: never shared or cached (sampling without a seed)
    row: str  # the user's prompt, to name the row in errors
    on_error: str = "raise"
    prior: str | None = None  # filter, classify: the key of the prior they are calibrated by


@dataclass
class Outcome:
    value: Any = None
    error: str | None = None


@dataclass
class _Pending:
    """A key being computed by some caller; others wait on `done`."""

    done: threading.Event = field(default_factory=threading.Event)
    outcome: Outcome | None = None  # None after done: the owner gave up (cancelled)


_inflight: dict[str, _Pending] = {}
_inflight_lock = threading.Lock()


def partial_key(key: str) -> str:
    """The result-cache entry of a call's tokens so far: [token ids or None] per request."""
    return f"{key}:partial"


def describe_row(function: str, row: str, cause: str) -> str:
    """The error naming the row by its prompt: a long one by its start and its end, where a
    template's shared instruction comes first and the row's own value usually last."""
    shown = row if len(row) <= 100 else f"{row[:40]}...{row[-57:]}"
    return f"{function} failed on the row with prompt {shown!r}: {cause}"


class _Batch:
    def __init__(self, session: Session, backend: Backend, function: str, calls: list[Call],
                 combine: Callable[[Call, list[BackendResult]], Any], as_rows: bool = True):
        self.session, self.backend, self.function = session, backend, function
        self.calls, self.combine, self.as_rows = calls, combine, as_rows
        self.outcomes: list[Outcome | None] = [None] * len(calls)
        self.stats = Stats(rows=len(calls) if as_rows else 0)
        self.cache = session.cache()
        self.done_q: queue.SimpleQueue = queue.SimpleQueue()
        self.handles: dict[int, list[str]] = {}  # call -> its backend handles
        self.parts: dict[int, list[BackendResult | None]] = {}
        self.owned: dict[int, _Pending] = {}  # keyed calls this batch computes for others
        self.foreign: dict[int, _Pending] = {}  # keyed calls another caller computes
        self.next_progress = 0.0
        self.next_checkpoint = time.perf_counter() + CHECKPOINT_EVERY_S
        self.resume: dict[int, list[list[int] | None]] = {}  # call -> tokens to go on from
        self.saved: dict[int, int] = {}  # call -> tokens its cached partial entry holds

    # ---- planning ------------------------------------------------------------------------

    def plan(self) -> tuple[list[int], dict[int, int]]:
        """Which calls to compute here; the rest are copies of an identical call."""
        first: dict[str, int] = {}
        copies: dict[int, int] = {}
        for i, c in enumerate(self.calls):
            if c.key is not None and c.key in first:
                copies[i] = first[c.key]
            elif c.key is not None:
                first[c.key] = i
        self.stats.dedup_hits += len(copies)
        hits = self.cache.get_many(list(first)) if self.cache is not None and first else {}
        todo = []
        for i, c in enumerate(self.calls):
            if i in copies:
                continue
            failed = self.session.failed_before(c.key)
            if failed is not None:  # a copy of that call (its error was counted there)
                self.outcomes[i] = Outcome(error=failed)
                self.stats.dedup_hits += self.as_rows
                if c.on_error == "raise":
                    raise LLMError(failed)
                continue
            if c.key in hits:
                self.outcomes[i] = Outcome(hits[c.key])
                self.stats.cache_hits += self.as_rows
                continue
            answered, value = self.session.answered_before(c.key)
            if answered:  # (the result cache is off: the query remembers its answers)
                self.outcomes[i] = Outcome(value)
                self.stats.dedup_hits += self.as_rows
                continue
            if c.key is not None:
                with _inflight_lock:
                    pending = _inflight.get(c.key)
                    if pending is None:
                        self.owned[i] = _inflight[c.key] = _Pending()
                if pending is not None:
                    self.foreign[i] = pending
                    continue
            todo.append(i)
        self.load_partials(todo)
        return todo, copies

    def load_partials(self, todo: list[int]) -> None:
        """The tokens an earlier run of these calls saved (see checkpoint)."""
        keys = {partial_key(self.calls[i].key): i for i in todo
                if self.calls[i].key is not None
                and any(isinstance(r, GenerationRequest) for r in self.calls[i].requests)}
        if self.cache is None or not keys:
            return
        for k, outs in self.cache.get_many(list(keys)).items():
            i = keys[k]
            self.resume[i] = outs
            self.saved[i] = sum(len(o) for o in outs if o)

    # ---- computing -----------------------------------------------------------------------

    def submit(self, i: int) -> None:
        call = self.calls[i]
        self.stats.model_rows += self.as_rows
        self.handles[i], self.parts[i] = [], [None] * len(call.requests)
        resume = self.resume.pop(i, None) or []
        for j, req in enumerate(call.requests):
            done = lambda i=i, j=j: self.done_q.put((i, j))  # noqa: E731
            try:
                tokens = resume[j] if j < len(resume) else None
                if tokens and isinstance(req, GenerationRequest):
                    try:
                        h = self.backend.submit(replace(req, resume_from=tuple(tokens)), done)
                    except ValueError:  # (tokens this backend no longer takes: start over)
                        h = self.backend.submit(req, done)
                        self.saved[i] = 0
                else:
                    h = self.backend.submit(req, done)
            except (TypeError, UnicodeError) as e:  # the row's text (a lone surrogate)
                self.fail(i, f"{type(e).__name__}: {e}")
                return
            except ValueError as e:
                self.fail(i, str(e))
                return
            self.handles[i].append(h)
            self.stats.calls += 1
            self.stats.calibration_calls += not self.as_rows

    def fail(self, i: int, cause: str) -> None:
        self.backend.abort(*self.handles.pop(i, []))
        self.parts.pop(i, None)
        self.session.progress_done()
        self.settle(i, Outcome(error=describe_row(self.function, self.calls[i].row, cause)))

    def settle(self, i: int, outcome: Outcome) -> None:
        self.outcomes[i] = outcome
        call = self.calls[i]
        if outcome.error is None and self.cache is not None and call.key is not None:
            # Now, not at the end of the batch; its saved tokens go in the same transaction.
            drop = [partial_key(call.key)] if self.saved.pop(i, None) is not None else []
            self.cache.put_many([(call.key, outcome.value)], delete=drop)
        if outcome.error is None:
            self.session.note_answer(call.key, outcome.value)
            self.release(i, outcome)
            return
        # A copy where another thread of the query failed this call first (this batch
        # waited for it): counted and listed there.
        first = self.session.note_failure(call.key, outcome.error) is None
        self.release(i, outcome)
        if first:
            self.stats.errors += self.as_rows
        else:
            self.stats.dedup_hits += self.as_rows
        if call.on_error == "raise":
            raise LLMError(outcome.error)
        if self.as_rows and first:  # (a failed prior is reported on the rows it calibrates)
            self.session.record_error(self.function, call.row, outcome.error)

    def release(self, i: int, outcome: Outcome | None) -> None:
        pending = self.owned.pop(i, None)
        if pending is not None:
            with _inflight_lock:
                del _inflight[self.calls[i].key]
            pending.outcome = outcome
            pending.done.set()

    def on_part_done(self, i: int, j: int) -> None:
        if i not in self.parts:  # the call already failed
            return
        res = self.backend.collect(self.handles[i][j])
        self.parts[i][j] = res
        self.stats.prompt_tokens += res.prompt_tokens
        self.stats.generated_tokens += res.generated_tokens
        self.stats.cached_tokens += res.cached_tokens
        self.stats.resumed_tokens += res.resumed_tokens
        if res.finish_reason in ("error", "abort"):
            self.fail(i, res.error or "the request was aborted")
            return
        if all(p is not None for p in self.parts[i]):
            parts = self.parts.pop(i)
            del self.handles[i]
            self.session.progress_done()
            self.settle(i, Outcome(self.combine(self.calls[i], parts)))

    def check_foreign(self) -> None:
        for i, pending in list(self.foreign.items()):
            if not pending.done.is_set():
                continue
            del self.foreign[i]
            if pending.outcome is None:  # its owner was cancelled: compute it here
                self.session.progress_add(1)
                self.load_partials([i])
                self.submit(i)
            elif pending.outcome.error is not None:
                self.settle(i, pending.outcome)
            else:
                self.outcomes[i] = pending.outcome
                self.stats.dedup_hits += self.as_rows

    def report_progress(self) -> None:
        """Rows in flight count for the share of their max_tokens generated so far, so that
        one big batch moves the bar, and its ETA, token by token rather than only when its
        rows finish together at the end. (A row that stops early at EOS then jumps ahead:
        the ETA errs long, never short.)"""
        now = time.perf_counter()
        if now < self.next_progress or not self.handles:
            return
        self.next_progress = now + PROGRESS_EVERY_S
        partial = 0.0
        for i, handles in list(self.handles.items()):
            budget = generated = 0
            for req, h in zip(self.calls[i].requests, handles, strict=False):
                if isinstance(req, GenerationRequest):
                    budget += req.params.max_tokens
                    generated += self.backend.generated_so_far(h)
            if budget:
                partial += min(1.0, generated / budget)
        self.session.progress_partial(partial)

    def checkpoint(self) -> None:
        """Save the tokens of the generations in flight that have grown since their last
        save, under partial_key, for a rerun to go on from."""
        self.next_checkpoint = time.perf_counter() + CHECKPOINT_EVERY_S
        if self.cache is None:
            return
        items = []
        for i, handles in list(self.handles.items()):
            call = self.calls[i]
            if call.key is None:
                continue
            outs = [self.backend.output_so_far(h) if isinstance(r, GenerationRequest) else None
                    for r, h in zip(call.requests, handles, strict=False)]
            total = sum(len(o) for o in outs if o)
            if total > self.saved.get(i, 0):
                self.saved[i] = total
                items.append((partial_key(call.key), outs))
        if items:
            self.cache.put_many(items)

    def keep_finished(self) -> None:
        """Settle the requests that came back before the batch was left early (a row failed
        under on_error='raise', or the query was cancelled): answers the backend already
        computed go to the result cache, so that the rerun does not pay for them again.
        The query's error is already on its way: further failures are counted, not raised."""
        while True:
            try:
                i, j = self.done_q.get_nowait()
            except queue.Empty:
                return
            try:
                self.on_part_done(i, j)
            except LLMError:
                pass

    def abort_all(self) -> None:
        self.backend.abort(*(h for handles in self.handles.values() for h in handles))
        self.handles.clear()
        for i in list(self.owned):
            self.release(i, None)

    def run(self) -> list[Outcome]:
        t0 = time.perf_counter()
        try:
            todo, copies = self.plan()
            self.session.progress_add(len(todo))
            for i in todo:
                self.submit(i)
            while self.handles or self.foreign:
                if self.session.cancel.is_set():
                    raise QueryCancelled("the query was cancelled")
                try:
                    i, j = self.done_q.get(timeout=WAIT_SLICE_S)
                except queue.Empty:
                    pass
                else:
                    self.on_part_done(i, j)
                self.check_foreign()
                self.report_progress()
                if time.perf_counter() >= self.next_checkpoint:
                    self.checkpoint()
        except (LLMError, QueryCancelled, KeyboardInterrupt):
            # (Ctrl-C reaches a DataFrame call here; SQL's is a QueryCancelled)
            self.keep_finished()
            self.checkpoint()
            raise
        finally:
            self.abort_all()  # a no-op unless the batch is being left early
            self.stats.engine_s += time.perf_counter() - t0
            self.session.record(self.stats)
        for i, src in copies.items():
            self.outcomes[i] = self.outcomes[src]
            if self.outcomes[i].error is not None and self.calls[i].on_error == "raise":
                raise LLMError(self.outcomes[i].error)
        return self.outcomes


def run_calls(session: Session, backend: Backend, function: str, calls: list[Call],
              combine: Callable[[Call, list[BackendResult]], Any], as_rows: bool = True
              ) -> list[Outcome]:
    """Each call's value, or its error when its on_error is 'null' (else LLMError).

    as_rows=False: the calls are the query's own work, not rows (calibration priors): their
    requests and tokens count, its rows and model_rows do not."""
    if not calls:
        return []
    return _Batch(session, backend, function, calls, combine, as_rows).run()
