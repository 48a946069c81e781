"""`llmdb calibrate`: time the real engine's steps on this machine and fit the cost model
(fit.py) to them.

Each measured step is a hand-built batch (decodes at given context lengths, prefill chunks
over given cached prefixes, mixes of both) run through ModelRunner.execute and the sampler,
the two things an engine step spends most of its time in. The scheduler and the per-token
bookkeeping are left out (real engine.step()s of 40-60 decodes ran ~20% above the fitted
model, probably their cost). Requests get blocks of their own from a region of the KV cache
written once up front, so decode attention reads real memory rather than the kernel's
shared zero page.

Timings on a shared 2-core machine are noisy, and badly so: with both cores running torch's
threads, another process taking one of them stalls every parallel region, and a 40 ms step
can take a second. So each timed run also reads how much CPU other processes used meanwhile
(/proc/stat minus /proc/self/stat); a run during which they used more than a sliver is
retried, a few times at most. Every pass runs the steps in a fresh random order, so a burst
of load lands on different steps in different passes, and each step keeps the median of its
quiet runs (of all its runs when none was quiet, which the report counts). On a GPU the
clock starts and stops with the device idle (torch.cuda.synchronize), other processes' CPU use
matters little and is only counted, and the steps reach the batches and chunks a GPU runs.

The result is written to the file of the engine's key (model, dtype, device, threads), where
the engine's own cost model is looked up (costmodel.load_cost_model).
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ..compute import run_on_compute_thread, run_on_device
from ..costmodel import FEATURES, CostModel, CostModelKey, cost_model_path, engine_cost_model_key
from .fit import Measured, Plan, fit, mape


def _decodes(batch: int, context: int) -> Plan:
    return [(context, 1, True)] * batch


@dataclass(frozen=True)
class PlanLimits:
    """What a step may hold in the engine being calibrated: a step it could never run says
    nothing about it, and one past its runner's buffers or pool would fail."""

    max_tokens: int = 1024  # the scheduler's token budget C
    max_seqs: int = 512  # requests in one step
    pool_blocks: int = 1 << 20  # blocks the timer can take from the pool
    block_size: int = 16
    max_context: int = 8192  # the model's context: prompt plus output
    gpu: bool = False

    @classmethod
    def of(cls, engine) -> PlanLimits:
        pool, sched = engine.pool, engine.scheduler
        device = getattr(engine, "device", None)
        return cls(max_tokens=sched.max_num_batched_tokens, max_seqs=sched.max_num_seqs,
                   pool_blocks=min(pool.num_blocks, pool.num_free), block_size=pool.block_size,
                   max_context=engine.config.max_context,
                   gpu=device is not None and device.type == "cuda")

    def blocks(self, plan: Plan) -> int:
        return sum(-(-(m + c) // self.block_size) for m, c, _ in plan)

    def fits(self, plan: Plan) -> bool:
        return (0 < len(plan) <= self.max_seqs
                and sum(c for _, c, _ in plan) <= self.max_tokens
                and all(m + c <= self.max_context for m, c, _ in plan)
                and self.blocks(plan) <= self.pool_blocks)


def _within(steps: list[tuple[str, Plan]], limits: PlanLimits | None) -> list[tuple[str, Plan]]:
    return steps if limits is None else [(k, p) for k, p in steps if limits.fits(p)]


def full_plan(limits: PlanLimits | None = None) -> list[tuple[str, Plan]]:
    """About 70 steps covering what the engine meets with its default budget: on the CPU
    its 1,024 tokens, on a GPU batches of hundreds of decodes and chunks of thousands of
    tokens; steps past the engine's limits are left out."""
    if limits is not None and limits.gpu:
        return _within(_gpu_full_plan(), limits)
    rng = random.Random(0)
    steps: list[tuple[str, Plan]] = []
    for context in (32, 128, 512, 1024):
        for batch in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            if batch * context <= 32 * 1024:  # the KV region written up front
                steps.append(("decode", _decodes(batch, context)))
    for batch in (8, 32, 96):  # uneven contexts, as in a real running batch
        steps.append(("decode", [(rng.randint(16, 1024), 1, True) for _ in range(batch)]))
    for tokens in (16, 32, 64, 128, 256, 512, 1024):
        for context in (0, 256, 1024):
            steps.append(("prefill", [(context, tokens, False)]))
    steps += [
        ("prefill", [(0, 128, False)] * 2),
        ("prefill", [(0, 64, False)] * 4),
        ("prefill", [(512, 256, False)] * 2),
        ("prefill", [(128, 32, False)] * 3),
    ]
    for batch, tokens, context in ((8, 64, 0), (8, 512, 256), (32, 256, 0), (32, 64, 512),
                                   (128, 512, 0), (128, 128, 256)):
        steps.append(("mixed", _decodes(batch, 256) + [(context, tokens, False)]))
    steps.append(("mixed", _decodes(16, 512) + [(0, 128, False)] * 2))
    return _within(steps, limits)


def _gpu_full_plan() -> list[tuple[str, Plan]]:
    """A GPU step costs about the same up to a few hundred decodes (weights dominate), so
    its plan reaches further: 512 decodes, contexts to 4K, prefill chunks to 8K tokens."""
    rng = random.Random(0)
    steps: list[tuple[str, Plan]] = []
    for context in (128, 512, 1024, 2048, 4096):
        for batch in (1, 4, 16, 32, 64, 128, 256, 384, 512):
            if batch * context <= 512 * 1024:
                steps.append(("decode", _decodes(batch, context)))
    for batch in (16, 96, 256, 512):
        steps.append(("decode", [(rng.randint(16, 4096), 1, True) for _ in range(batch)]))
    for tokens in (64, 256, 512, 1024, 2048, 4096, 8192):
        for context in (0, 1024, 4096):
            steps.append(("prefill", [(context, tokens, False)]))
    steps += [
        ("prefill", [(0, 512, False)] * 4),
        ("prefill", [(0, 1024, False)] * 4),
        ("prefill", [(2048, 1024, False)] * 2),
        ("prefill", [(512, 128, False)] * 8),
    ]
    for batch, tokens, context in ((16, 512, 0), (64, 2048, 0), (128, 1024, 1024),
                                   (256, 4096, 0), (256, 512, 2048), (512, 2048, 512)):
        steps.append(("mixed", _decodes(batch, 1024) + [(context, tokens, False)]))
    steps.append(("mixed", _decodes(128, 2048) + [(0, 1024, False)] * 2))
    return steps


def quick_plan(limits: PlanLimits | None = None) -> list[tuple[str, Plan]]:
    """A dozen small steps: enough to exercise the fit end to end in a few seconds."""
    steps: list[tuple[str, Plan]] = []
    for batch in (1, 4, 16):
        for context in (32, 128):
            steps.append(("decode", _decodes(batch, context)))
    for tokens in (16, 64):
        for context in (0, 64):
            steps.append(("prefill", [(context, tokens, False)]))
    steps.append(("mixed", _decodes(4, 64) + [(0, 32, False)]))
    steps.append(("mixed", _decodes(8, 32) + [(64, 16, False)]))
    return _within(steps, limits)


# ---- timing the real engine ---------------------------------------------------------------


class StepTimer:
    """Runs hand-built steps on an engine's runner and sampler.

    Its blocks are taken from the engine's pool (which evicts whatever prefix they cached)
    and given back by close(), so an idle engine is left consistent, if with a colder cache.
    """

    def __init__(self, engine, max_context_tokens: int):
        import torch

        self.engine = engine
        pool = engine.pool
        self.block_size = bs = pool.block_size
        self.blocks = pool.allocate(min(pool.num_free, -(-max_context_tokens // bs)))
        # Written once so every block used below is resident, as it is in a warm engine. On
        # the compute thread, slot arithmetic included: a parallel torch op on this thread
        # would give it an OpenMP team of its own and slow every step (engine/compute.py).
        def fill() -> None:
            slots = (torch.tensor(self.blocks)[:, None] * bs + torch.arange(bs)).flatten()
            for k, v in engine.kv_cache.layers:
                slots = slots.to(k.device)
                k.index_fill_(0, slots, 0.01)
                v.index_fill_(0, slots, 0.01)

        run_on_compute_thread(fill)

    def close(self) -> None:
        self.engine.pool.free(self.blocks)
        self.blocks = []

    def build(self, plan: Plan) -> list[tuple]:
        from ..params import SamplingParams
        from ..sched.request import Request

        scheduled, next_block = [], 0
        for i, (context, tokens, _decode) in enumerate(plan):
            # The prompt ends with this chunk, so each request wants one row of logits: a
            # decode to sample, a prefill chunk to sample its first token.
            req = Request(f"calibrate-{i}", [100] * (context + tokens), SamplingParams())
            need = -(-(context + tokens) // self.block_size)
            if next_block + need > len(self.blocks):
                raise ValueError(f"a calibration step needs more than {len(self.blocks)} blocks")
            req.block_ids = self.blocks[next_block : next_block + need]
            req.num_computed = context
            next_block += need
            scheduled.append((req, tokens))
        return scheduled

    def run(self, scheduled: list[tuple]) -> float:
        """Seconds of one step, timed on the compute thread where the engine's steps run."""
        return run_on_device(self.engine.device, self._timed_step, scheduled)

    def _timed_step(self, scheduled: list[tuple]) -> float:
        """One step's wall time, sampling and the device's work included (the runner copies
        the sampled ids to the host); on CUDA the clock starts on an idle device."""
        sync = _synchronizer(self.engine)
        sync()
        t0 = time.perf_counter()
        self.engine.runner.execute(scheduled)
        sync()
        return time.perf_counter() - t0


def engine_device(engine):
    """The engine's torch.device (engines without one run on the CPU)."""
    import torch

    return getattr(engine, "device", torch.device("cpu"))


def _synchronizer(engine):
    """A call that waits for the engine's device to finish its queued work (none on a CPU,
    where every op returns when done)."""
    import torch

    device = engine_device(engine)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _jiffies() -> tuple[int, int] | None:
    """(CPU time used by the whole machine, by this process), in clock ticks; None off
    Linux."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(
                int, f.readline().split()[1:9])
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    return user + nice + system + irq + softirq + steal, int(fields[11]) + int(fields[12])


def _others_were_busy(before, after, seconds: float) -> bool:
    """Did other processes use more than a tick plus 5% of the machine during the run?"""
    if before is None or after is None:
        return False
    others = (after[0] - before[0]) - (after[1] - before[1])
    capacity = seconds * os.sysconf("SC_CLK_TCK") * (os.cpu_count() or 1)
    return others > 1 + 0.05 * capacity


def _wait_for_quiet(timeout: float, window: float = 0.25) -> bool:
    """Wait until other processes leave the CPU idle for `window` seconds, or timeout."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        before = _jiffies()
        time.sleep(window)
        if not _others_were_busy(before, _jiffies(), window):
            return True
    return False


def measure(engine, steps: Sequence[tuple[str, Plan]], passes: int, tries: int = 3,
            budget_s: float | None = None, seed: int = 0, progress=None) -> list[Measured]:
    """Times every step `passes` times after one warm-up pass (which also lets the kernels
    pick their code paths for each shape), shuffling the order on every pass; on the CPU a
    run disturbed by other processes is retried, after a pause in their load (at most 10 s),
    up to `tries` times in all. Past `budget_s` seconds there are no more retries nor passes
    (one pass always completes). A GPU step hardly depends on other processes' CPU use: it
    is never retried for it, and keeps all its runs."""
    t0 = time.perf_counter()
    on_gpu = engine_device(engine).type == "cuda"
    bs = engine.pool.block_size
    max_blocks = max(sum(-(-(m + c) // bs) for m, c, _ in plan) for _, plan in steps)
    timer = StepTimer(engine, max_blocks * bs)
    quiet: list[list[float]] = [[] for _ in steps]
    noisy: list[list[float]] = [[] for _ in steps]
    try:
        built = [timer.build(plan) for _, plan in steps]
        for i in range(len(steps)):  # warm-up
            timer.run(built[i])
        rng = random.Random(seed)
        order = list(range(len(steps)))
        for p in range(passes):
            if p and budget_s is not None and time.perf_counter() - t0 > budget_s:
                break
            rng.shuffle(order)
            for i in order:
                left = budget_s - (time.perf_counter() - t0) if budget_s else 10.0
                _time_step(timer, built[i], 1 if on_gpu else tries, left,
                           quiet[i], noisy[i])
            if progress:
                progress(p + 1, passes)
    finally:
        timer.close()
    out = []
    for (kind, plan), q, n in zip(steps, quiet, noisy, strict=True):
        ts = q + n if on_gpu else q or n
        out.append(Measured(kind, plan, statistics.median(ts), min(ts), max(ts) / min(ts),
                            quiet=len(q), disturbed=len(n)))
    return out


def _time_step(timer: StepTimer, scheduled: list[tuple], tries: int, left_s: float,
               quiet: list[float], noisy: list[float]) -> None:
    """Times one step into `quiet` or `noisy`, retrying a disturbed run (up to `tries` runs
    in all, while `left_s` of the budget lasts) once the others pause, rather than straight
    into their load."""
    deadline = time.perf_counter() + left_s
    for attempt in range(tries):
        if attempt:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            _wait_for_quiet(min(10.0, left))
        before = _jiffies()
        t = timer.run(scheduled)
        if not _others_were_busy(before, _jiffies(), t):
            quiet.append(t)
            return
        noisy.append(t)



@dataclass
class Calibration:
    model: CostModel
    measured: list[Measured]
    held_out: list[Measured]
    mape_held_out: float
    mape_train: float
    seconds: float
    path: Path | None = None
    key: CostModelKey | None = None


def machine_info(engine) -> dict:
    import torch

    from llmdb.kernels.host import cpu_info

    from ..hardware import BF16_FLAGS

    device = engine_device(engine)
    info = {
        "cpu": cpu_info().model,
        "cores": os.cpu_count(),
        "torch_threads": run_on_compute_thread(torch.get_num_threads),  # the steps' thread
        "bf16_flags": sorted(BF16_FLAGS & cpu_info().flags),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": engine.model_name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(device),
        "load_average": list(os.getloadavg()),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def load_engine(model: str | None = None, device: str | None = None, log=print,
                dtype: str | None = None, threads: int | None = None):
    """The engine to calibrate: `model` (default: the default model) on `device` ("cpu",
    "cuda", "cuda:N" or "auto"; None or "auto" on a machine without CUDA means the CPU,
    and the CPU is asked for with no device argument, as engines before devices took it),
    in `dtype` with `threads` CPU threads (None: the engine's defaults)."""
    import torch

    from ..engine import LLMEngine
    from ..registry import DEFAULT_MODEL

    if device in (None, "auto") and not torch.cuda.is_available():
        device = "cpu"
    log(f"loading the engine ({model or DEFAULT_MODEL} on {device}) ...")
    kwargs = {} if device == "cpu" else {"device": device}
    kwargs.update({k: v for k, v in (("dtype", dtype), ("threads", threads)) if v is not None})
    return LLMEngine(model or DEFAULT_MODEL, **kwargs)


def check_output(path: Path) -> Path:
    """`path` if a calibration can be written there, else a ValueError saying why: checked
    before the timing, which would otherwise be lost at the write."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{path} is a directory; give a file name, e.g. "
                         f"{path / 'costmodel.json'}")
    parent = path.parent
    while not parent.exists():  # the write makes the missing directories
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"cannot write {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {path}: {parent} is not writable")
    return path


def calibrate(quick: bool = False, passes: int | None = None, path: Path | None = None,
              engine=None, tries: int = 3, budget_s: float | None = None, log=print,
              model: str | None = None, device: str | None = None, dtype: str | None = None,
              threads: int | None = None) -> Calibration:
    """Measure, fit, and write the cost model of an engine: `engine`, or one loaded for
    `model` on `device` in `dtype` with `threads` (see load_engine). It goes to `path`,
    default the file of the engine's key (cost_model_path), where the engine will look for
    it. The timing stops adding passes after budget_s (default 150 s, 30 s with quick),
    which keeps a run near three minutes even on a loaded machine."""
    t0 = time.perf_counter()
    if passes is None:
        passes = 2 if quick else 4
    elif passes < 1:
        raise ValueError(f"a calibration needs at least 1 timed pass, not {passes}")
    if path is not None:
        path = check_output(path)
    if engine is None:
        engine = load_engine(model, device, log, dtype, threads)
    key = engine_cost_model_key(engine)
    limits = PlanLimits.of(engine)
    steps = quick_plan(limits) if quick else full_plan(limits)
    if not any(kind == "decode" for kind, _ in steps):
        raise ValueError(f"no calibration step fits this engine's limits ({limits})")
    load_before = os.getloadavg()[0]
    log(f"timing {len(steps)} steps of {key.label()}, {passes} passes after a warm-up pass ...")
    if budget_s is None:
        budget_s = 30.0 if quick else 150.0
    measured = measure(engine, steps, passes, tries=tries, budget_s=budget_s,
                       progress=None if quick else lambda p, n: log(f"  pass {p}/{n} done"))
    info = machine_info(engine)
    info["load_average_before"] = load_before
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    model, train, held = fit(measured, engine.config, f"calibrated {date}", key)
    held_mape, train_mape = mape(model, held), mape(model, train)
    held_ids = {id(m) for m in held}
    elapsed = time.perf_counter() - t0
    path = path if path is not None else cost_model_path(key)
    payload = {
        **model.to_dict(),
        "key": key.to_dict(),
        "date": date,
        "machine": info,
        "mape_held_out_pct": held_mape,
        "mape_train_pct": train_mape,
        "steps": len(measured),
        "held_out_steps": len(held),
        "passes": passes,
        "quick": quick,
        "calibration_s": elapsed,
        "disturbed_runs": sum(m.disturbed for m in measured),
        "quiet_runs": sum(m.quiet for m in measured),
        "measured": [{"kind": m.kind, "plan": m.plan, "seconds": m.seconds,
                      "fastest": m.fastest, "spread": m.spread, "quiet_runs": m.quiet,
                      "disturbed_runs": m.disturbed, "held_out": id(m) in held_ids}
                     for m in measured],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=1))
        tmp.replace(path)  # a reader never sees half a file
    except OSError:
        if tmp.is_file():
            tmp.unlink()
        raise
    return Calibration(model, measured, held, held_mape, train_mape, elapsed, path, key)


def report(cal: Calibration) -> str:
    c = cal.model.coefficients
    lines = [f"wrote {cal.path}" + (f" for {cal.key.label()}" if cal.key else ""),
             f"held-out MAPE per step: {cal.mape_held_out:.1f}% on {len(cal.held_out)} steps "
             f"(training {cal.mape_train:.1f}%, target <= 15%)",
             f"floor {cal.model.floor_s * 1e3:.1f} ms; calibration took {cal.seconds:.0f} s"]
    lines += [f"  {f:<14} {c[f]:.4g} s" for f in FEATURES]
    disturbed = sum(m.disturbed for m in cal.measured)
    runs = disturbed + sum(m.quiet for m in cal.measured)
    never_quiet = sum(not m.quiet for m in cal.measured)
    if disturbed and cal.key is not None and cal.key.gpu is not None:
        lines.append(f"note: other processes were busy on the CPU during {disturbed} of {runs} "
                     "timed runs (kept: a GPU step hardly depends on them).")
    elif disturbed:
        lines.append(f"note: other processes were busy during {disturbed} of {runs} timed "
                     f"runs (discarded and retried); {never_quiet} of {len(cal.measured)} "
                     "steps never ran undisturbed"
                     + (": rerun on a quiet machine." if never_quiet else "."))
    return "\n".join(lines)
