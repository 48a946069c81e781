"""Fitting the cost model to measured steps: non-negative least squares on relative error,
judged on held-out steps (calibrate.py measures them)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..costmodel import FEATURES, Chunk, CostModel, CostModelKey, features, kv_projection_fraction

# (context m, tokens c, decode) per request of one step.
Plan = list[tuple[int, int, bool]]


@dataclass
class Measured:
    kind: str  # "decode", "prefill" or "mixed": the held-out split is stratified by it
    plan: Plan
    seconds: float  # median of the runs kept (the quiet ones, if any)
    fastest: float  # the quickest run kept, for comparison on a loaded machine
    spread: float  # slowest / fastest of the runs kept
    quiet: int = 0  # runs during which other processes stayed (nearly) idle
    disturbed: int = 0  # runs discarded because they did not

    @property
    def chunks(self) -> list[Chunk]:
        return [Chunk(m, c, d) for m, c, d in self.plan]



def nnls(a: np.ndarray, b: np.ndarray, tol: float | None = None) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method).

    scipy.optimize.nnls does the same; a dozen columns and a hundred rows are not worth the
    dependency."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = a.shape[1]
    if tol is None:
        tol = 10 * max(a.shape) * np.finfo(float).eps * max(1.0, np.abs(a).max())
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 10):
        grad = a.T @ (b - a @ x)
        candidates = ~passive & (grad > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, grad, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            # Step from x toward z as far as feasibility allows, and drop what hits zero.
            bad = passive & (z <= tol)
            gap = x[bad] - z[bad]  # > 0 but for rounding on a variable already at zero
            alpha = np.min(np.where(gap > 0, x[bad] / np.where(gap > 0, gap, 1.0), 0.0))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
    return x


def design_matrix(steps: Sequence[Sequence[Chunk]], names: Sequence[str]) -> np.ndarray:
    return np.array([[features(chunks)[f] for f in names] for chunks in steps])


def fit_coefficients(steps: Sequence[Sequence[Chunk]], seconds: Sequence[float],
                     names: Sequence[str] = FEATURES) -> dict[str, float]:
    """Non-negative coefficients minimizing the squared *relative* error of each step (rows
    divided by the measured time), since the target is percentage error per step."""
    a = design_matrix(steps, names)
    t = np.asarray(seconds, dtype=float)
    a = a / t[:, None]
    b = np.ones(len(t))
    # Features span 1 to 1e6: unit columns keep the active-set tolerances meaningful.
    scale = np.linalg.norm(a, axis=0)
    used = scale > 0
    x = np.zeros(len(names))
    x[used] = nnls(a[:, used] / scale[used], b) / scale[used]
    return {f: float(v) for f, v in zip(names, x, strict=True)}


def mape(model: CostModel, measured: Sequence[Measured]) -> float:
    errors = [abs(model.step_time(m.chunks) - m.seconds) / m.seconds for m in measured]
    return 100.0 * float(np.mean(errors)) if errors else float("nan")


def split_held_out(measured: Sequence[Measured], fraction: float = 0.25,
                   seed: int = 0) -> tuple[list[Measured], list[Measured]]:
    """(train, held out): about `fraction` of each kind of step held out."""
    rng = random.Random(seed)
    train, held = [], []
    for kind in sorted({m.kind for m in measured}):
        group = [m for m in measured if m.kind == kind]
        rng.shuffle(group)
        k = max(1, round(fraction * len(group))) if len(group) > 1 else 0
        held += group[:k]
        train += group[k:]
    return train, held


# Hidden-cache re-projection cannot be measured (the engine has no hidden cache): it is
# derived from the fitted per-token cost instead.
FITTED = tuple(f for f in FEATURES if f != "hidden_tokens")


def fit(measured: Sequence[Measured], config, source: str, key: CostModelKey | None = None
        ) -> tuple[CostModel, list[Measured], list[Measured]]:
    """(model, training steps, held-out steps): fitted on ~75% of the steps, to be judged on
    the rest. The model is the one fitted on the training steps, so the error reported on
    the held-out ones is that of the coefficients written. `key` names the model (default:
    a CPU's)."""
    train, held = split_held_out(measured)
    coef = fit_coefficients([m.chunks for m in train], [m.seconds for m in train], FITTED)
    coef["hidden_tokens"] = coef["tokens"] * kv_projection_fraction(config)
    decodes = [m for m in measured if m.kind == "decode"]
    # The floor: the smallest decode step, i.e. the fastest of the one-request decodes (their
    # context barely matters, and the fastest is the least disturbed by other load).
    batch = min(len(m.plan) for m in decodes)
    floor = min(m.seconds for m in decodes if len(m.plan) == batch)
    name = "cpu" if key is None or key.device == "cpu" else f"calibrated-{key.gpu}"
    return CostModel(name, coef, source, floor_s=floor), train, held

