"""One thread runs every model computation of the process.

Why: torch's OpenMP runtime (libgomp) keeps a team of worker threads for each OS thread that
starts parallel regions. Once two threads have teams, the process has more OpenMP threads
than cores, and libgomp then cuts its spin-wait between regions to about a hundred
iterations, so each parallel region (an engine step has ~500) pays a futex sleep and wake-up.
Measured on this 2-core VM: a bf16 add of [256, 576] takes 25-33 us from the only thread with
a team and 78-108 us from a second one; engine steps ran 1.5-1.9x slower on the background
loop thread than on the thread that had loaded the model. So engines load their weights,
allocate their caches and run their steps on this one thread, whichever thread calls them.
(Computations a user starts on other threads still create teams of their own; that is
outside our control.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_thread_ident: int | None = None


def _mark_thread() -> None:
    global _thread_ident
    _thread_ident = threading.get_ident()


def _forget_after_fork() -> None:
    # The executor's thread does not exist in a forked child; it starts a new one on demand.
    global _executor, _thread_ident
    _executor, _thread_ident = None, None


os.register_at_fork(after_in_child=_forget_after_fork)


def run_on_compute_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread; its result, or its exception re-raised.
    Called from the compute thread itself, fn simply runs."""
    global _executor
    if threading.get_ident() == _thread_ident:
        return fn(*args, **kwargs)
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="llmdb-compute",
                                           initializer=_mark_thread)
        executor = _executor
    return executor.submit(fn, *args, **kwargs).result()


def run_on_device(device: torch.device, fn: Callable[..., T], *args, **kwargs) -> T:
    """run_on_compute_thread with `device` the thread's current CUDA device while fn runs:
    Triton launches its kernels, and torch records an event given no stream, on the current
    device, not the one the tensors are on, so an engine on cuda:1 would run on cuda:0."""
    if device.type != "cuda":
        return run_on_compute_thread(fn, *args, **kwargs)
    return run_on_compute_thread(_on_device, device, fn, args, kwargs)


def _on_device(device: torch.device, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    with torch.cuda.device(device):
        return fn(*args, **kwargs)
