"""amaxd's ModelOpt conventions against the installed ModelOpt's own functions,
over random and edge-case amax values (one daemon, one rank):

- FP8 current, output "modelopt": scale_inv = export.quant_utils.get_scaling_factor
  (export_amax: 0 -> 448, clamp to [FLT_MIN, FLT_MAX]; amax / 448);
- NVFP4 "modelopt" (dynamic): block scales = NVFP4QTensor.get_weights_scaling_factor
  and global_scale_inv = its weights_scaling_factor_2 (g / 2688);
- NVFP4 "modelopt_static": NVFP4QTensor.get_weights_scaling_factor_from_quantizer
  (static branch, _cast_per_block_scale_to_fp8);
- MXFP8 "modelopt" against MXFP8QTensor._compute_e8m0_exponent (the E8M0 byte)
  and quantize_with_scale / dequantize (exp2(127 - e), exp2(e - 127)): equal
  everywhere, also just above 448 * 2^k where ModelOpt's float32 log2 rounds
  down to k and TE's rule (amaxd's default) rounds up
  (test_mxfp8_just_above_a_power_of_two; exhaustive_mxfp8.py checks all 2^31
  float32 amax values outside pytest).
"""
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("modelopt.torch.quantization")
from modelopt.torch.export.quant_utils import get_scaling_factor  # noqa: E402
from modelopt.torch.quantization.config import QuantizerAttributeConfig  # noqa: E402
from modelopt.torch.quantization.nn import TensorQuantizer  # noqa: E402
from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor  # noqa: E402
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # noqa: E402

import amaxd  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from amaxd_proc import Daemon  # noqa: E402

F32 = np.float32


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("amaxd")))
    yield d
    d.check_clean_exit(d.stop())


_jobs = iter(range(10 ** 6))


def reconcile_one(daemon, recipe, values):
    """One quantizer of values.shape, fed `values`, reconciled; the job is dropped."""
    with daemon.client(f"numerics-{next(_jobs)}", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("q", list(values.shape), recipe)])
        c.send({"q": values})
        r = c.reconcile()["q"]
        c.reset(drop_job=True)
    return r


def mismatches(got, want, amax):
    got, want = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    u = np.uint8 if got.itemsize == 1 else np.uint32
    bad = np.flatnonzero(got.view(u) != want.view(u))
    return [f"amax {amax.reshape(-1)[i]!r} ({amax.reshape(-1)[i].view(np.uint32):#010x}): "
            f"amaxd {got[i]!r}, ModelOpt {want[i]!r}" for i in bad[:10]], bad.size


def random_amax(rng, n):
    a = np.exp(rng.uniform(-80, 80, n)).astype(F32)
    a[:6] = [0, 1e-45, 1e-40, 1.17549435e-38, 448, 3.4028235e38]
    return a


def test_fp8_scale_inv_is_get_scaling_factor(daemon):
    a = random_amax(np.random.default_rng(1), 20000)
    r = reconcile_one(daemon, amaxd.Recipe.fp8_current(output="modelopt"), a)
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3), axis=0))
    q.amax = torch.from_numpy(a.reshape(-1, 1))
    with pytest.warns(UserWarning):  # ModelOpt warns about the zero amax it replaces by 448
        want = get_scaling_factor(q).numpy()
    bad, n = mismatches(r.scale_inv, want, a)
    assert n == 0, "\n".join(bad)


def _weight(blocks):
    """A weight whose 1x16 blocks have exactly the given amax."""
    w = np.zeros((blocks.shape[0], blocks.shape[1] * 16), F32)
    w[:, ::16] = blocks
    return torch.from_numpy(w)


def _nvfp4_blocks(rng, lo, hi):
    b = np.exp(rng.uniform(lo, hi, (64, 16))).astype(F32)
    b[0, :4] = 0  # zero blocks: ModelOpt's "scale 0 -> 1.0"
    b[1] *= F32(2.0 ** -30)  # blocks far below the global amax
    b[b < F32(1e-44)] = 0
    return b


@pytest.mark.parametrize("lo,hi", [(-80, 80), (-20, 20), (-100, -85)])
def test_nvfp4_dynamic_is_get_weights_scaling_factor(daemon, lo, hi):
    rng = np.random.default_rng([2, -lo])
    for _ in range(5):
        b = _nvfp4_blocks(rng, lo, hi)
        r = reconcile_one(daemon, amaxd.Recipe.nvfp4("modelopt", output="modelopt"), b)
        wsf2 = torch.tensor(b.max()) / (6.0 * 448.0)  # get_weights_scaling_factor_2_from_quantizer
        want, _ = NVFP4QTensor.get_weights_scaling_factor(_weight(b), 16, wsf2)
        bad, n = mismatches(r.block_scales, want.view(torch.uint8).numpy(), b)
        assert n == 0, "\n".join(bad)
        assert F32(r.global_scale_inv).tobytes() == wsf2.numpy().tobytes()


class _StaticQuantizer:
    """What get_weights_scaling_factor_from_quantizer reads of a static NVFP4 quantizer."""

    def __init__(self, blocks, g):
        self.block_sizes = {-1: 16, "type": "static", "scale_bits": (4, 3)}
        self._amax = torch.from_numpy(blocks.reshape(-1, 1).copy())
        self.global_amax = torch.tensor(g)


@pytest.mark.parametrize("lo,hi", [(-80, 80), (-20, 20), (-100, -85)])
def test_nvfp4_static_is_get_weights_scaling_factor_from_quantizer(daemon, lo, hi):
    rng = np.random.default_rng([3, -lo])
    for _ in range(5):
        b = _nvfp4_blocks(rng, lo, hi)
        r = reconcile_one(daemon, amaxd.Recipe.nvfp4("modelopt_static", output="modelopt"), b)
        want, wsf2 = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(
            _StaticQuantizer(b, b.max()), _weight(b))
        bad, n = mismatches(r.block_scales, want.view(torch.uint8).numpy(), b)
        assert n == 0, "\n".join(bad)
        assert F32(r.global_scale_inv).tobytes() == wsf2.numpy().tobytes()


def test_nvfp4_all_zero_weight(daemon):
    """ModelOpt's 0/0 (docs/NUMERICS.md "ModelOpt 0/0"): an all-zero weight has
    weight_scale_2 = 0, so ModelOpt's dynamic block scale is 0/0 = NaN (an
    E4M3 NaN byte); amaxd answers 1.0 (0x38). The static path gives 448 (0x7e) on both."""
    b = np.zeros((2, 4), F32)
    r = reconcile_one(daemon, amaxd.Recipe.nvfp4("modelopt", output="modelopt"), b)
    want, _ = NVFP4QTensor.get_weights_scaling_factor(_weight(b), 16, torch.tensor(0.0) / 2688.0)
    assert torch.isnan(want.float()).all()
    assert set(r.block_scales.ravel()) == {0x38}
    r = reconcile_one(daemon, amaxd.Recipe.nvfp4("modelopt_static", output="modelopt"), b)
    want, _ = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(_StaticQuantizer(b, 0.0),
                                                                     _weight(b))
    assert set(want.view(torch.uint8).numpy().ravel()) == set(r.block_scales.ravel()) == {0x7E}


def _e8m0_modelopt(a):
    return (MXFP8QTensor._compute_e8m0_exponent(torch.from_numpy(a)) + 127).to(torch.uint8).numpy()


def _powers_of_two_times_448(rng):
    return np.ldexp(F32(448), rng.integers(-135, 120, 3000)).astype(F32)


def _modelopt_scales(e):
    """ModelOpt's encode (quantize_with_scale) and decode (dequantize) factors of E8M0 bytes."""
    e = torch.from_numpy(np.ascontiguousarray(e)).float()
    return torch.exp2(127 - e).numpy(), torch.exp2(e - 127).numpy()


@pytest.mark.parametrize("convention", ["te", "modelopt"])
def test_mxfp8_e8m0_is_modelopt(daemon, convention):
    """Random amaxes, 448 * 2^k exactly and just below: amaxd's E8M0, TE's
    (float_to_e8m0 of a * float(1/448)) as well as "modelopt", is ModelOpt's
    ceil(log2(a / 448)); the scales of both are ModelOpt's exp2(127 - e) and
    exp2(e - 127) (TE main's exp2f_rcp / exp2f give the same powers of two
    for every byte, 0 included: docs/NUMERICS.md, "MXFP8 byte 0")."""
    rng = np.random.default_rng(4)
    p2 = _powers_of_two_times_448(rng)
    a = np.concatenate([random_amax(rng, 20000), p2[np.isfinite(p2)],
                        np.nextafter(p2[np.isfinite(p2)], F32(0))]).astype(F32)
    r = reconcile_one(daemon, amaxd.Recipe.mxfp8(convention), a)
    want = _e8m0_modelopt(a)
    bad, n = mismatches(r.block_scales, want, a)
    assert n == 0, "\n".join(bad)
    assert (want == 0).any()  # zero amax: byte 0, 2^127 / 2^-127
    enc, dec = _modelopt_scales(want)
    for got, w in ((r.scale, enc), (r.scale_inv, dec)):
        bad, n = mismatches(got, w, a)
        assert n == 0, "\n".join(bad)


def _above_powers_of_two(width):
    """Every float32 from 448 * 2^k - width ulps to 448 * 2^k + width ulps, for every
    k with 448 * 2^k a positive finite float32 (-157..119), and 0."""
    b = np.ldexp(448.0, np.arange(-160, 121))
    b = b[(b >= 2.0 ** -149) & (b < 2.0 ** 128)].astype(F32).view(np.uint32).astype(np.int64)
    u = (b[:, None] + np.arange(-width, width + 1)[None, :]).ravel()
    u = np.unique(np.concatenate([[0], u[(u >= 0) & (u < 0x7f800000)]]))
    return u.astype(np.uint32).view(F32)


def test_mxfp8_just_above_a_power_of_two(daemon):
    """ModelOpt 0.47 takes ceil(log2(a/448)) in float32; for a a few ulps above
    448*2^k (|k| >= 4) the float32 log2 is exactly k, so ModelOpt's exponent is
    k where TE's float_to_e8m0 rounds up to k+1: e.g. amax 0x3ce00001
    (0.027343752): TE 114, ModelOpt 113. "modelopt" is ModelOpt's for every
    float32 within 64 ulps of every 448*2^k (35,000 values), with its scales."""
    rng = np.random.default_rng(5)
    p2 = _powers_of_two_times_448(rng)
    a = np.nextafter(p2[np.isfinite(p2) & (p2 < F32(3e38))], F32(np.inf)).astype(F32)
    a = np.concatenate([np.array([0.027343752], F32), a, _above_powers_of_two(64),
                        np.array([1e-45, 3.4028235e38], F32)])
    want = _e8m0_modelopt(a)
    te = reconcile_one(daemon, amaxd.Recipe.mxfp8(), a)
    r = reconcile_one(daemon, amaxd.Recipe.mxfp8("modelopt"), a)
    assert (int(te.block_scales[0]), int(r.block_scales[0]), int(want[0])) == (114, 113, 113)
    bad, n = mismatches(r.block_scales, want, a)
    assert n == 0, f"{n} of {a.size} differ:\n" + "\n".join(bad)
    enc, dec = _modelopt_scales(want)
    for got, w in ((r.scale, enc), (r.scale_inv, dec)):
        bad, n = mismatches(got, w, a)
        assert n == 0, "\n".join(bad)
    _, n_te = mismatches(te.block_scales, want, a)
    assert n_te > 4000, n_te  # the gap "modelopt" closes
