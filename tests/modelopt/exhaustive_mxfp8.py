"""amaxd's MXFP8 `modelopt` E8M0 rule (daemon/recipe.h amx_mxfp8_e8m0_modelopt)
against ModelOpt's own MXFP8QTensor._compute_e8m0_exponent (torch, CPU) for
every float32 amax: all 2^31 non-negative bit patterns (0, subnormals, every
normal, FLT_MAX, inf, the NaNs), in chunks of 2^24. A standalone script (a
few minutes; not collected by pytest), run in the ModelOpt tier's venv:

  .venv-modelopt/bin/python tests/modelopt/exhaustive_mxfp8.py [--windows W]

--windows W checks only the W bit patterns either side of every 448 * 2^k
and every amax below 2^-100 (the subnormal quotients), which is quick; use
it to repeat the check under other torch / MKL settings, e.g.
MKL_ENABLE_INSTRUCTIONS=SSE4_2, MKL_CBWR=COMPATIBLE, ATEN_CPU_CAPABILITY=default.
It also checks torch's float32 log2 of amax / 448 itself against the
correctly rounded one ((float)log2((double)q)) and reports the values where
it is not. Exit status 0 when amaxd and ModelOpt agree everywhere.

--log2 instead scans torch.log2 over every positive finite float32 x:
how many results are not the correctly rounded float32, how far off, the
one nearest an integer, and whether ceil ever differs (what ModelOpt's
exponent depends on).
"""
import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor

F32 = np.float32
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def amaxd_rule():
    """amx_mxfp8_e8m0_modelopt and amx_mxfp8_e8m0 (TE) compiled from daemon/recipe.h."""
    d = tempfile.mkdtemp()
    src, lib = os.path.join(d, "e8m0.c"), os.path.join(d, "e8m0.so")
    with open(src, "w") as f:
        f.write('#include "recipe.h"\n'
                "void mo(const float *a, uint8_t *o, size_t n)\n"
                "{ for (size_t i = 0; i < n; i++) o[i] = amx_mxfp8_e8m0_modelopt(a[i]); }\n"
                "void te(const float *a, uint8_t *o, size_t n)\n"
                "{ for (size_t i = 0; i < n; i++) o[i] = amx_mxfp8_e8m0(a[i]); }\n")
    subprocess.check_call([os.environ.get("CC", "cc"), "-O2", "-ffp-contract=off", "-shared",
                           "-fPIC", "-I", os.path.join(ROOT, "daemon"), src, "-o", lib])
    so = ctypes.CDLL(lib)

    def run(fn, a):
        out = np.empty(a.size, np.uint8)
        fn(a.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
           ctypes.c_size_t(a.size))
        return out
    return (lambda a: run(so.mo, a)), (lambda a: run(so.te, a))


def modelopt_bytes(a):
    e = MXFP8QTensor._compute_e8m0_exponent(torch.from_numpy(a))
    return (e + 127).to(torch.uint8).numpy()


def chunks(windows):
    ch = 1 << 24
    if windows is None:
        for s in range(0, 1 << 31, ch):
            yield np.arange(s, s + ch, dtype=np.uint32)
        return
    low = int(np.float32(2.0 ** -100).view(np.uint32))
    yield np.arange(0, low, dtype=np.uint32)
    b = np.ldexp(448.0, np.arange(-160, 121))
    b = b[(b >= 2.0 ** -149) & (b < 2.0 ** 128)].astype(F32).view(np.uint32).astype(np.int64)
    u = (b[:, None] + np.arange(-windows, windows + 1)[None, :]).ravel()
    u = np.unique(u[(u >= low) & (u <= 0x7f800000)]).astype(np.uint32)
    for s in range(0, u.size, ch):
        yield u[s:s + ch]


def log2_scan():
    n = sub = worst = ceil_diff = 0
    nearest = (1.0, None)
    for s in range(1, 0x7f800000, 1 << 24):
        u = np.arange(s, min(s + (1 << 24), 0x7f800000), dtype=np.uint32)
        x = u.view(F32)
        lt = torch.log2(torch.from_numpy(x)).numpy()
        lc = np.log2(x.astype(np.float64)).astype(F32)
        d = np.flatnonzero(lt != lc)
        if not d.size:
            continue
        n += d.size
        sub += int(np.count_nonzero(u[d] < 0x00800000))
        worst = max(worst, int(np.abs(lt[d].view(np.int32).astype(np.int64)
                                      - lc[d].view(np.int32).astype(np.int64)).max()))
        ceil_diff += int(np.count_nonzero(np.ceil(lt[d]) != np.ceil(lc[d])))
        dist = np.abs(lc[d].astype(np.float64) - np.rint(lc[d].astype(np.float64)))
        i = int(np.argmin(dist))
        if dist[i] < nearest[0]:
            nearest = (float(dist[i]), f"x {u[d][i]:#010x}: torch {lt[d][i]!r}, correctly rounded {lc[d][i]!r}")
    print(f"torch.log2 (float32, CPU) is not correctly rounded for {n} of {0x7f800000 - 1} positive "
          f"finite inputs ({sub} of them subnormal), off by at most {worst} ulp; nearest to an "
          f"integer: {nearest[1]} ({nearest[0]:.2g} away); ceil differs for {ceil_diff}")
    return 1 if ceil_diff else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--log2", action="store_true")
    args = ap.parse_args()
    if args.log2:
        return log2_scan()
    mo, te = amaxd_rule()
    t0 = time.time()
    n = bad = te_diff = log2_off = 0
    for u in chunks(args.windows):
        a = u.view(F32)
        got, want = mo(a), modelopt_bytes(a)
        d = np.flatnonzero(got != want)
        bad += d.size
        for i in d[:10]:
            print(f"MISMATCH amax {u[i]:#010x} ({a[i]!r}): amaxd {got[i]}, ModelOpt {want[i]}")
        fin = np.isfinite(a)
        te_diff += int(np.count_nonzero(te(a)[fin] != want[fin]))
        q = torch.from_numpy(a[fin]) / MXFP8QTensor.E4M3_MAX
        pos = q > 0
        lt = torch.log2(q[pos]).numpy()
        lc = np.log2(q[pos].numpy().astype(np.float64)).astype(F32)
        off = np.flatnonzero(lt.view(np.uint32) != lc.view(np.uint32))
        log2_off += off.size
        for i in off[:1]:
            print(f"torch.log2 not correctly rounded: q {q[pos][i].item()!r}: {lt[i]!r} vs {lc[i]!r}")
        n += a.size
    print(f"{n} amax bit patterns: {bad} differ from ModelOpt "
          f"(TE's rule differs on {te_diff} finite ones); torch.log2(amax / 448) is not the "
          f"correctly rounded float32 log2 for {log2_off}; {time.time() - t0:.0f} s "
          f"(torch {torch.__version__}, MKL {torch.backends.mkl.is_available()}, "
          f"{torch.backends.cpu.get_cpu_capability()})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
