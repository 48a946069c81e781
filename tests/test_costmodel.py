"""The step cost model: features, presets, the NNLS fit, loading, and a quick calibration."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from llmdb.engine import calibrate as cal
from llmdb.engine.costmodel import (
    FEATURES,
    Chunk,
    CostModel,
    cost_model_path,
    features,
    load_cost_model,
    preset,
)


def test_features_of_hand_made_steps():
    assert features([]) == dict.fromkeys(FEATURES, 0.0)
    one = features([Chunk(100, 1, True)])
    assert one == {**dict.fromkeys(FEATURES, 0.0), "const": 1.0, "tokens": 1.0,
                   "decode_kv": 100.0, "decode_on": 1.0, "n_decode": 1.0}
    mixed = features([Chunk(10, 1, True), Chunk(20, 1, True, hidden=5), Chunk(30, 1, True),
                      Chunk(0, 8, False), Chunk(16, 4, False)])
    assert mixed["const"] == 1.0
    assert mixed["tokens"] == 3 + 8 + 4
    assert mixed["decode_kv"] == pytest.approx(60 * 1.1)
    assert mixed["decode_on"] == pytest.approx(1.1)
    assert mixed["n_decode"] == 3
    # sum(c^2 + 2cm) = (64 + 0) + (16 + 2*4*16) = 208, times 1.1 for two prefill chunks.
    assert mixed["prefill_attn"] == pytest.approx(208 * 1.1)
    assert mixed["prefill_on"] == pytest.approx(1.1)
    assert mixed["n_prefill"] == 2
    assert mixed["prefill_m"] == 16
    assert mixed["hidden_tokens"] == 5
    lone_prefill = features([Chunk(4, 3, False)])
    assert lone_prefill["prefill_attn"] == 9 + 24 and lone_prefill["prefill_on"] == 1.0
    assert lone_prefill["decode_on"] == 0.0


@pytest.mark.parametrize("bad", [dict(computed=-1, tokens=1, decode=False),
                                 dict(computed=0, tokens=0, decode=False),
                                 dict(computed=5, tokens=2, decode=True)])
def test_chunks_reject_impossible_work(bad):
    with pytest.raises(ValueError):
        Chunk(**bad)


def infermax_ms_per_layer(decodes: list[int], prefills: list[tuple[int, int]]) -> float:
    """InferMax's Llama-2-7B/A100 formulas as printed (DESIGN.md), written out separately.
    decodes: KV read per decode; prefills: (c, m) per chunk."""
    b, n = len(decodes), len(prefills)
    tokens = b + sum(c for c, _ in prefills)
    t = 1.91e-3 * tokens + 0.0649
    if b:
        t += (8.513e-6 * sum(decodes) + 0.0192) * (1 + 0.1 * (b > 1)) + 7.4e-4 * b
    if n:
        quad = sum(c * c + 2 * c * m for c, m in prefills)
        t += (1.677e-7 * quad + 0.0926) * (1 + 0.1 * (n > 1)) + 1.534e-3 * n
        t += 9.224e-6 * sum(m for _, m in prefills)
    return t


@pytest.mark.parametrize("decodes,prefills", [
    ([500], []),
    ([100, 2000, 37, 4096], []),
    ([], [(512, 0)]),
    ([], [(512, 1024), (64, 0), (3000, 8)]),
    ([300] * 64, [(256, 512)]),
])
def test_llama2_preset_reproduces_infermax(decodes, prefills):
    chunks = [Chunk(m, 1, True) for m in decodes] + [Chunk(m, c, False) for c, m in prefills]
    expected = infermax_ms_per_layer(decodes, prefills) * 32 / 1000
    model = preset("llama2-7b-a100")
    assert model.step_time(chunks) == pytest.approx(expected, rel=1e-12)
    assert model.floor_s == 0.0  # InferMax's model as is, floor and all


def test_opt13b_preset_matches_apt_serve_decode_figure():
    model = preset("opt13b-a100")
    # Assumed context: 12 GB of cache over 50 requests at 819,200 bytes per token.
    assert 2 * 40 * 5120 * 2 == 819_200
    context = round(12e9 / 819_200 / 50)
    assert context == 293
    batch = [Chunk(context, 1, True)] * 50
    assert model.step_time(batch) == pytest.approx(0.120, rel=0.02)
    # The floor is reading 26 GB at 80% of 1.5 TB/s, and a lone decode sits just above it.
    assert model.floor_s == pytest.approx(26e9 / 1.2e12)
    assert 0.02 < model.step_time([Chunk(context, 1, True)]) < 0.03
    # rho: K and V re-projection, 2 h^2 x 2 FLOPs x 40 layers at 50% of 312 TFLOP/s.
    assert model.rho == pytest.approx(2 * 5120**2 * 2 * 40 / 156e12)
    # More context or more requests never makes a step cheaper.
    assert model.step_time([Chunk(1000, 1, True)] * 50) > model.step_time(batch)
    assert model.step_time(batch + [Chunk(0, 512, False)]) > model.step_time(batch)


def test_floor_empty_step_and_swaps():
    model = CostModel("t", {"const": 0.001, "tokens": 0.0001}, "test", floor_s=0.01,
                      swap_bytes_per_s=1e9)
    assert model.step_time([]) == 0.0
    assert model.step_time([Chunk(5, 1, True)]) == 0.01  # below the floor
    assert model.step_time([Chunk(0, 1000, False)]) == pytest.approx(0.101)
    assert model.step_time([Chunk(5, 1, True)], swap_bytes=10**8) == pytest.approx(0.1)
    assert model.step_time([], swap_bytes=10**6) == pytest.approx(0.001)
    with pytest.raises(ValueError, match="swap"):
        CostModel("t", {}, "test").step_time([Chunk(0, 1, False)], swap_bytes=1)
    with pytest.raises(ValueError):
        CostModel("t", {"const": -1.0}, "test")
    with pytest.raises(ValueError, match="unknown"):
        CostModel("t", {"flops": 1.0}, "test")


def test_nnls_matches_known_solutions():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (60, 6))
    x_true = np.array([0.5, 0.0, 2.0, 0.0, 1.0, 3.0])
    assert np.allclose(cal.nnls(a, a @ x_true), x_true, atol=1e-9)
    # An unconstrained fit would go negative: check the KKT conditions instead.
    b = a @ np.array([1.0, -2.0, 0.5, 0.0, 0.0, 1.0]) + rng.normal(0, 0.01, 60)
    x = cal.nnls(a, b)
    grad = a.T @ (b - a @ x)
    assert (x >= 0).all()
    assert np.all(grad[x == 0] <= 1e-9) and np.allclose(grad[x > 0], 0, atol=1e-9)


def _random_step(rng: random.Random) -> list[Chunk]:
    decodes = [Chunk(rng.randint(1, 2000), 1, True) for _ in range(rng.choice([0, 1, 5, 40]))]
    prefills = [Chunk(rng.choice([0, 256, 1024]), rng.randint(1, 1024), False)
                for _ in range(rng.choice([0, 1, 1, 3]) if decodes else rng.choice([1, 2]))]
    return decodes + prefills


def test_fit_recovers_known_coefficients():
    rng = random.Random(1)
    truth = {"const": 0.03, "tokens": 2e-4, "decode_kv": 3e-7, "decode_on": 0.002,
             "n_decode": 5e-4, "prefill_attn": 1e-9, "prefill_on": 0.0, "n_prefill": 0.004,
             "prefill_m": 2e-6}
    model = CostModel("truth", truth, "test")
    steps = [_random_step(rng) for _ in range(300)]
    fitted = cal.fit_coefficients(steps, [model.linear_time(s) for s in steps], cal.FITTED)
    for f, v in truth.items():
        assert fitted[f] == pytest.approx(v, rel=1e-6, abs=1e-12), f
    assert all(v >= 0 for v in fitted.values())


def test_load_falls_back_to_the_default_and_reads_a_calibrated_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    path = cost_model_path()
    assert path == tmp_path / "costmodel-cpu.json"
    default = load_cost_model()
    assert "built-in default" in default.source
    assert default.step_time([Chunk(64, 1, True)] * 8) > 0
    assert preset("cpu").source == default.source

    coef = dict.fromkeys(FEATURES, 1e-3)
    calibrated = CostModel("cpu", coef, "calibrated", floor_s=0.02)
    path.write_text(json.dumps({**calibrated.to_dict(), "date": "2026-11-22"}))
    loaded = load_cost_model(None)
    assert loaded.coefficients == coef and loaded.floor_s == 0.02
    assert "calibrated 2026-11-22" in loaded.source and str(path) in loaded.source

    path.write_text("{not json")
    broken = load_cost_model("cpu")
    assert "built-in default" in broken.source and "unreadable" in broken.source
    assert load_cost_model("llama2-7b-a100").name == "llama2-7b-a100"
    with pytest.raises(ValueError, match="presets"):
        load_cost_model("h100")


def test_quick_calibration_end_to_end(tmp_path, monkeypatch):
    from llmdb.engine.engine import LLMEngine

    engine = LLMEngine(kv_cache_bytes=64 << 20)  # bf16 where native, as `llmdb calibrate`
    free = engine.pool.num_free
    out = tmp_path / "cache" / "costmodel-cpu.json"
    result = cal.calibrate(quick=True, passes=1, tries=1, path=out, engine=engine,
                           log=lambda _: None)
    assert engine.pool.num_free == free  # its blocks went back to the pool
    data = json.loads(out.read_text())
    assert set(data["coefficients"]) == set(FEATURES)
    assert all(v >= 0 for v in data["coefficients"].values())
    assert data["floor_s"] > 0 and data["quick"] is True
    assert data["held_out_steps"] >= 3 and math.isfinite(data["mape_held_out_pct"])
    assert data["machine"]["model"] == "smollm2-135m"
    assert result.mape_held_out == data["mape_held_out_pct"]
    assert "MAPE" in cal.report(result)
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    assert load_cost_model().source.startswith("calibrated ")
