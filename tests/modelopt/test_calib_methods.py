"""The daemon's calibrator arithmetic (daemon/calib.c, loaded through
ctypes from build/libamaxd_calib.so) against ModelOpt 0.47's own functions
(modelopt/torch/quantization/calib/histogram.py: _compute_amax_entropy,
_compute_amax_mse, _compute_amax_percentile; the bin edges of
HistogramCalibrator.collect) on the same histograms, byte for byte: random
histograms, histograms of real data, and adversarial ones (empty bins,
all mass in one bin, an empty histogram, counts up to 2^24), percentiles
0, 50 and 100, every start_bin/stride/num_bits/unsigned the methods take.

ModelOpt 0.47's _compute_amax_mse calls fake_tensor_quant(centers, amax,
num_bits, unsigned) and scaled_e4m3(centers, amax, 4, 3), whose third
parameter is `bias`: its integer grid quantizes with num_bits = unsigned
(the search returns the first candidate for any non-negative histogram)
and its E4M3 grid raises TypeError. The daemon computes what the function
means; the comparison repairs the two calls (keywords in the right
places) and leaves every other line of ModelOpt's function as it is
(docs/NUMERICS.md, "ModelOpt 0.47's histogram MSE call").
"""
import ctypes
import os
import warnings

import numpy as np
import pytest
import torch

from modelopt.torch.quantization import tensor_quant as TQ
from modelopt.torch.quantization.calib import histogram as H

import amaxd

warnings.filterwarnings("ignore", category=RuntimeWarning)

LIB = os.path.join(os.path.dirname(os.path.abspath(os.environ.get("AMAXD_BIN", "build/amaxd"))),
                   "libamaxd_calib.so")
_f32p, _f64p = ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_double)


@pytest.fixture(scope="module")
def lib():
    if not os.path.exists(LIB):
        pytest.skip(f"{LIB} not built")
    L = ctypes.CDLL(LIB)
    for fn in ("amx_hist_percentile", "amx_hist_entropy", "amx_hist_mse"):
        getattr(L, fn).restype = ctypes.c_float
    return L


# This process's torch build: whose linspace (FMA or not) to reproduce.
CPU = amaxd.types.torch_cpu()
SCRATCH = np.zeros(1 << 22, np.uint8)


@pytest.fixture
def repaired(monkeypatch):
    """_compute_amax_mse with its two quantizer calls given their arguments
    by keyword; nothing else of it changed."""
    monkeypatch.setattr(H, "fake_tensor_quant",
                        lambda x, amax, nb, u: TQ.fake_tensor_quant(x, amax, None, nb, u))
    monkeypatch.setattr(H, "scaled_e4m3", lambda x, amax, e, m: TQ.scaled_e4m3(x, amax, None, e, m))


def edges_c(lib, g, nb):
    e = np.zeros(nb + 1, np.float32)
    lib.amx_hist_edges(ctypes.c_float(g), ctypes.c_uint32(nb), CPU, e.ctypes.data_as(_f32p))
    return e


def bits(x):
    return np.float32(x).view(np.uint32)


def histograms(rng, n, sizes):
    """(kind, int32 histogram) pairs: random, sparse, one bin, real data,
    empty, extreme counts."""
    out = []
    for i in range(n):
        nb = int(rng.choice(sizes))
        kind = ["random", "sparse", "one_bin", "data", "empty", "huge", "first_last"][i % 7]
        if kind == "random":
            h = rng.integers(0, 1000, nb)
        elif kind == "sparse":
            h = rng.integers(1, 100000, nb) * (rng.random(nb) < 0.05)
        elif kind == "one_bin":
            h = np.zeros(nb, np.int64)
            h[int(rng.choice([0, min(1, nb - 1), nb - 1, int(rng.integers(0, nb))]))] = \
                int(rng.integers(1, 1 << 20))
        elif kind == "data":
            x = np.abs(rng.standard_t(df=float(rng.uniform(1.5, 10)), size=20000)).astype(np.float32)
            h = torch.histc(torch.from_numpy(x), bins=nb, min=0, max=float(x.max())).int().numpy()
        elif kind == "empty":
            h = np.zeros(nb, np.int64)
        elif kind == "huge":
            h = rng.integers(0, (1 << 24) - 1, nb) * (rng.random(nb) < 0.5)
        else:
            h = np.zeros(nb, np.int64)
            h[0], h[-1] = rng.integers(1, 1000, 2)
        out.append((kind, np.asarray(h, dtype=np.int32)))
    return out


def test_edges_are_torch_linspace(lib):
    """HistogramCalibrator.collect's edges: torch.linspace(0, x_max, num_bins + 1)."""
    rng = np.random.default_rng(1)
    for _ in range(300):
        g = np.float32(np.exp(rng.uniform(-40, 40)))
        nb = int(rng.choice([1, 2, 3, 7, 100, 2047, 2048, 4097, 32767]))
        want = torch.linspace(0, float(g), nb + 1).numpy()
        got = edges_c(lib, g, nb)
        assert got.tobytes() == want.tobytes(), (g, nb)
        assert np.array_equal(amaxd.calib.edges(g, amaxd.Calibrator.histogram(num_bins=nb)), want)


def test_percentile(lib):
    rng = np.random.default_rng(2)
    n = 0
    for kind, h in histograms(rng, 210, [1, 2, 3, 64, 100, 2048, 5000]):
        g = np.float32(np.exp(rng.uniform(-20, 20)))
        e = torch.linspace(0, float(g), h.size + 1).numpy()
        hd = h.astype(np.float64)
        for p in (0.0, 50.0, 100.0, 99.99, 99.9, float(rng.uniform(0, 100))):
            want = H._compute_amax_percentile(h.copy(), e, p).item()
            got = lib.amx_hist_percentile(hd.ctypes.data_as(_f64p), h.size, e.ctypes.data_as(_f32p),
                                          ctypes.c_double(p))
            assert bits(got) == bits(want), (kind, h.size, p, got, want)
            n += 1
    assert n == 210 * 6


@pytest.mark.parametrize("grid", ["int", "e4m3"])
def test_histogram_mse(lib, repaired, grid):
    rng = np.random.default_rng(3 if grid == "int" else 4)
    cases = histograms(rng, 35, [17, 64, 129, 300, 2048])
    for i, (kind, h) in enumerate(cases):
        nb = h.size
        g = np.float32(np.exp(rng.uniform(-12, 12)))
        e = torch.linspace(0, float(g), nb + 1).numpy()
        nbits, uns = int(rng.choice([8, 4, 6])), bool(rng.integers(0, 2))
        stride = int(rng.choice([1, 1, 2, 5]))
        start = int(min(rng.choice([128, 0, 1, 7]), nb - 1))
        arg = (4, 3) if grid == "e4m3" else nbits
        want = H._compute_amax_mse(h.copy(), e, arg, uns, stride, start).item()
        hd = h.astype(np.float64)
        got = lib.amx_hist_mse(hd.ctypes.data_as(_f64p), nb, e.ctypes.data_as(_f32p),
                               1 if grid == "int" else 2, nbits if grid == "int" else 0,
                               int(uns and grid == "int"), stride, start, CPU,
                               SCRATCH.ctypes.data_as(ctypes.c_void_p))
        assert bits(got) == bits(want), (kind, nb, nbits, uns, stride, start, got, want)


def test_entropy(lib):
    rng = np.random.default_rng(5)
    # ModelOpt's entropy is Python loops (seconds per 2048-bin histogram):
    # two at full size, the rest small.
    cases = [(k, h) for k, h in histograms(rng, 42, [16, 33, 64, 100, 256])]
    cases += histograms(np.random.default_rng(6), 4, [2048])[2:4]
    for kind, h in cases:
        nb = h.size
        g = np.float32(np.exp(rng.uniform(-12, 12)))
        e = torch.linspace(0, float(g), nb + 1).numpy()
        nbits, uns = int(rng.choice([8, 4, 3, 1])), bool(rng.integers(0, 2))
        stride = int(rng.choice([1, 1, 3]))
        start = int(min(rng.choice([128, 1, 5, nb]), nb))
        want = H._compute_amax_entropy(h.copy(), e, nbits, uns, stride, start).item()
        hd = h.astype(np.float64)
        got = lib.amx_hist_entropy(hd.ctypes.data_as(_f64p), nb, e.ctypes.data_as(_f32p), nbits,
                                   int(uns), stride, start, SCRATCH.ctypes.data_as(ctypes.c_void_p))
        assert bits(got) == bits(want), (kind, nb, nbits, uns, stride, start, got, want)


def test_modelopt_047_mse_call_as_shipped():
    """What the repaired comparison works around, pinned: as shipped, the
    integer grid's search returns its first candidate, the E4M3 grid raises."""
    rng = np.random.default_rng(7)
    x = np.abs(rng.standard_normal(100000)).astype(np.float32)
    h = torch.histc(torch.from_numpy(x), bins=2048, min=0, max=float(x.max())).int().numpy()
    e = torch.linspace(0, float(x.max()), 2049).numpy()
    centers = (torch.from_numpy(e[1:]) + torch.from_numpy(e[:-1])) / 2
    for nb, uns in ((8, False), (8, True), (4, False)):
        got = H._compute_amax_mse(h.copy(), e, nb, uns, 1, 128)
        assert got.item() == centers[128].item()
    with pytest.raises(TypeError):
        H._compute_amax_mse(h.copy(), e, (4, 3), False, 1, 128)


def test_mse_candidates():
    """MseCalibrator._generate_candidates: torch.linspace(start, stop, nsteps)."""
    for start, stop, step in ((0.25, 4.0, 0.1), (0.5, 1.5, 0.05), (0.1, 10.0, 0.07), (1, 1, 0.1)):
        cal = amaxd.Calibrator.mse(start, stop, step)
        from modelopt.torch.quantization.calib.mse import MseCalibrator
        m = MseCalibrator(torch.tensor(1.0), step_size=step, start_multiplier=start,
                          stop_multiplier=stop)
        want = m._generate_candidates(torch.device("cpu")).numpy()
        assert cal.nsteps == m._num_steps
        assert amaxd.calib.mse_candidates(cal).tobytes() == want.tobytes()
