"""The GEMM model and its fit: a synthetic profile with known constants is recovered."""
import numpy as np
import pytest

from batchgen.calibrate.gemm_fit import (Bound, fit_collectives, fit_gemms, fit_params, predict_collectives,
                                         predict_gemms)
from batchgen.calibrate.vidur import CollectivePoints, GemmPoints
from batchgen.latency.gemm import gemm_seconds
from batchgen.specs import HardwareSpec

H100 = HardwareSpec(name="h100", bf16_tflops=989, hbm_gb=80, hbm_gbs=3350, pcie_gbs=64, nvlink_gbs=450,
                    network_gbs=50, sm_count=132)
TRUE = {"compute": 0.72, "memory": 0.83, "kernel_s": 4e-6, "gemm_pad_rows": 0.0}


def synthetic(hw, params, noise=0.0, seed=0) -> GemmPoints:
    tokens = np.array([1, 2, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096.0])
    shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 768), (512, 4096)]
    m = np.repeat(tokens, len(shapes))
    k, n = (np.tile([s[i] for s in shapes], len(tokens)).astype(float) for i in (0, 1))
    pts = GemmPoints(op=np.full(m.shape, "mlp_up_proj", dtype=object), m=m, k=k, n=n, tp=np.ones_like(m),
                     seconds=np.ones_like(m), model=np.full(m.shape, "synthetic", dtype=object))
    t = predict_gemms(pts, hw, params) * np.exp(np.random.default_rng(seed).normal(0, noise, m.shape))
    return GemmPoints(**{**pts.__dict__, "seconds": t})


@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_fit_recovers_known_constants_tiled(noise):
    fit = fit_gemms(synthetic(H100, TRUE, noise), H100)
    for name in ("compute", "memory", "kernel_s"):
        assert fit.params[name] == pytest.approx(TRUE[name], rel=0.05), name
    assert fit.params["gemm_pad_rows"] == 0.0


def test_fit_recovers_pad_rows_without_sm_count():
    hw = HardwareSpec(**{**H100.to_dict(), "sm_count": 0})
    true = {**TRUE, "gemm_pad_rows": 96.0}
    fit = fit_gemms(synthetic(hw, true), hw)
    for name in ("compute", "memory", "kernel_s"):
        assert fit.params[name] == pytest.approx(true[name], rel=0.05), name
    assert fit.params["gemm_pad_rows"] == pytest.approx(96.0, rel=0.1)


def test_gemm_seconds_pad_rows_roofline_and_zero_rows():
    kw = dict(peak_flops=1e15, mem_bw=3e12, weight_bytes=2, act_bytes=2, compute=0.5, memory=0.8, kernel_s=5e-6,
              pad_rows=64.0, calls=2)
    t = gemm_seconds(np.array([0.0, 4096.0]), 4096, 4096, **kw)
    flops = 2 * (4096 + 64 * 2) * 4096 * 4096
    bytes_ = 4096 * 4096 * 2 * 2 + (4096 * 4096 * 2) * 2
    assert t[0] == 0.0
    assert t[1] == pytest.approx(max(flops / 0.5e15, bytes_ / 2.4e12) + 2 * 5e-6)


def test_tiled_model_has_wave_steps_and_broadcasts():
    kw = dict(peak_flops=H100.flops_bf16, mem_bw=H100.hbm_bw, weight_bytes=2, act_bytes=2, compute=0.8,
              memory=0.9, kernel_s=0.0, pad_rows=0.0, sm_count=132)
    m = np.arange(1, 4097, dtype=float)
    t = gemm_seconds(m, 8192, 28672, **kw)
    assert t.shape == m.shape and np.all(np.diff(t) >= -1e-12)  # more rows never cost less
    jumps = t[1:] / t[:-1] - 1
    assert jumps.max() > 0.05  # a new wave is a step, not a slope
    grid = gemm_seconds(m[:, None], 4096, np.array([1024.0, 4096.0])[None, :], calls=np.array([[1], [2]])[:1], **kw)
    assert grid.shape == (4096, 2)


def test_fit_params_generic_quadratic():
    x = np.linspace(1, 10, 50)
    y = 3.0 * x + 2.0
    p = fit_params(lambda q: q["a"] * x + q["b"], y, {"a": Bound(0.1, 10, log=True), "b": Bound(0, 5)},
                   {"a": 1.0, "b": 0.0})
    assert p["a"] == pytest.approx(3.0, rel=0.01) and p["b"] == pytest.approx(2.0, rel=0.02)


def test_collective_fit_recovers_constants():
    size = np.geomspace(2048, 6.4e7, 40)
    workers = np.array([2.0, 4.0, 8.0])
    b, w = np.meshgrid(size, workers)
    pts = CollectivePoints(collective=np.full(b.size, "all_reduce", dtype=object), bytes=b.ravel(),
                           workers=w.ravel(), devices_per_node=np.full(b.size, 8.0), seconds=np.ones(b.size))
    true = {"link": 0.6, "collective_s": 15e-6, "collective_per_peer_s": 2e-6}
    pts = CollectivePoints(**{**pts.__dict__, "seconds": predict_collectives(pts, H100, true)})
    fit = fit_collectives(pts, H100)
    for name, value in true.items():
        assert fit.params[name] == pytest.approx(value, rel=0.05), name
