"""Export: a job's reconciled scales as safetensors, read back with the
`safetensors` package and compared with GetScales; amaxctl and the Python
client write the same bytes."""
import json
import os
import subprocess

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file
from safetensors import safe_open

import amaxd
from amaxd import placement as P

CTL = os.environ.get("AMAXCTL_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build", "amaxctl"))
W = 2


def calibrate(d, job="exp"):
    qs = lambda r: [  # noqa: E731
        amaxd.Quantizer("a.weight", [8], amaxd.Recipe.fp8_current(), P.column_parallel([8], r, W)),
        amaxd.Quantizer("a.input", [], amaxd.Recipe.fp8_delayed(history_len=2),
                        accumulation=amaxd.PER_EPOCH),
        amaxd.Quantizer("b.nvfp4", [3, 4], amaxd.Recipe.nvfp4(), P.shard([3, 4], 1, r, W)),
        amaxd.Quantizer("c.mx", [5], amaxd.Recipe.mxfp8()),
        amaxd.Quantizer('q"uote\\d', [2], amaxd.Recipe.fp8_current(amaxd.FP8_E5M2)),
    ]
    import threading
    errs = []

    def rank(r):
        try:
            with d.client(job, r, W) as c:
                c.join()
                c.register(qs(r))
                rng = np.random.default_rng(r)
                for _ in range(2):
                    c.send({"a.weight": rng.uniform(0, 3, 4).astype(np.float32),
                            "a.input": np.float32(rng.uniform(1, 9)),
                            "b.nvfp4": rng.uniform(0, 9, (3, 2)).astype(np.float32),
                            "c.mx": rng.uniform(0, 1e-3, 5).astype(np.float32),
                            'q"uote\\d': np.array([r + 1.0, 0.0], np.float32)})
                    c.reconcile()
        except Exception as e:  # noqa: BLE001
            errs.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(W)]
    [t.start() for t in ts]
    [t.join(60) for t in ts]
    assert not errs, errs


def test_export_round_trip_python_and_amaxctl(daemon, tmp_path):
    calibrate(daemon)
    py, cl = str(tmp_path / "py.safetensors"), str(tmp_path / "ctl.safetensors")
    with daemon.client("exp", 0, W) as c:
        assert c.export(py) == 2
        want = c.get_scales(whole=True)
        infos = {q.name: q for q in c.list_quantizers().quantizers}
    p = subprocess.run([CTL, "--socket", daemon.socket, "export", "exp", cl], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "epoch 2: 5 quantizers written" in p.stdout
    # The same bytes from both writers.
    assert open(py, "rb").read() == open(cl, "rb").read()
    got = load_file(py)
    for n, r in want.items():
        np.testing.assert_array_equal(got[n + ".amax"], r.amax)
        assert got[n + ".amax"].shape == tuple(infos[n].global_shape)
        assert got[n + ".scale"].tobytes() == r.scale.tobytes()
        assert got[n + ".scale_inv"].tobytes() == r.scale_inv.tobytes()
        assert got[n + ".global_amax"].shape == ()
        assert got[n + ".global_amax"].tobytes() == np.float32(r.global_amax).tobytes()
        assert got[n + ".global_scale"].tobytes() == np.float32(r.global_scale).tobytes()
        assert got[n + ".global_scale_inv"].tobytes() == np.float32(r.global_scale_inv).tobytes()
        if infos[n].recipe.format in (amaxd.NVFP4, amaxd.MXFP8):
            assert got[n + ".block_scale"].dtype == np.uint8
            assert got[n + ".block_scale"].tobytes() == r.block_scales.tobytes()
        else:
            assert n + ".block_scale" not in got
    # NVFP4 block scales are E4M3 bits: dequantized they give the decode scale.
    blocks = got["b.nvfp4.block_scale"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.all(blocks > 0)
    with safe_open(py, framework="numpy") as f:
        meta = f.metadata()
    assert meta["amaxd.format"] == "scales/1" and meta["amaxd.job"] == "exp"
    assert meta["amaxd.epoch"] == "2"
    qs = {q["name"]: q for q in json.loads(meta["amaxd.quantizers"])}
    assert qs["b.nvfp4"] == {"name": "b.nvfp4", "shape": [3, 4], "format": "nvfp4",
                             "block_scale": "e4m3"}
    assert qs["c.mx"]["block_scale"] == "e8m0" and qs["a.input"]["shape"] == []


def test_export_of_a_job_without_epochs_and_errors(daemon, tmp_path):
    with daemon.client("empty", 0, 1) as c:
        c.join()
        path = str(tmp_path / "e.safetensors")
        assert c.export(path) == 0
    assert load_file(path) == {}
    p = subprocess.run([CTL, "--socket", daemon.socket, "export", "nope", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "NOT_FOUND" in p.stderr
    calibrate(daemon, "exp2")
    p = subprocess.run([CTL, "--socket", daemon.socket, "export", "exp2",
                        str(tmp_path / "no" / "such" / "dir.safetensors")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "cannot create" in p.stderr
    assert not os.path.exists(tmp_path / "x")


def test_export_in_small_windows(start_daemon, tmp_path):
    # With max_message_bytes 16384, the 3000-cell quantizer (39 kB of
    # results) cannot come in one answer: both writers fetch it in windows
    # (amaxctl halves its first, refused window until it fits).
    d = start_daemon("--max-message-bytes=16384")
    calibrate(d)
    with d.client("big", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("big", [3000], amaxd.Recipe.mxfp8()),
                    amaxd.Quantizer("tiny", [], amaxd.Recipe.fp8_current())])
        c.send({"big": np.linspace(0, 5, 3000, dtype=np.float32), "tiny": 1.0})
        c.reconcile(names=["tiny"])  # the whole answer would not fit either
        ref = str(tmp_path / "ref.safetensors")
        c.export(ref)
    out = str(tmp_path / "w.safetensors")
    p = subprocess.run([CTL, "--socket", d.socket, "export", "big", out], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert open(ref, "rb").read() == open(out, "rb").read()
    got = load_file(out)
    np.testing.assert_array_equal(got["big.amax"], np.linspace(0, 5, 3000, dtype=np.float32))


def test_export_of_global_slices_python_and_amaxctl(start_daemon, tmp_path):
    # A quantizer with global_axes = 1: NAME.global_amax has shape [E], in
    # windows too (max_message_bytes 16384 cuts the 2400-cell tensor).
    d = start_daemon("--max-message-bytes=16384")
    E = 6
    rng = np.random.default_rng(5)
    w = (rng.uniform(0, 1, (E, 20, 20)) * np.arange(1, E + 1)[:, None, None]).astype(np.float32)
    with d.client("sl", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("w", [E, 20, 20], amaxd.Recipe.nvfp4(), global_axes=1),
                    amaxd.Quantizer("x", [], amaxd.Recipe.fp8_current())])
        c.send({"w": w, "x": 2.0})
        c.reconcile(names=["x"])
        py = str(tmp_path / "py.safetensors")
        c.export(py)
        want = c.get_scales(whole=True)
    cl = str(tmp_path / "ctl.safetensors")
    p = subprocess.run([CTL, "--socket", d.socket, "export", "sl", cl], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert open(py, "rb").read() == open(cl, "rb").read()
    got = load_file(py)
    assert got["w.global_amax"].shape == (E,)
    np.testing.assert_array_equal(got["w.global_amax"], w.reshape(E, -1).max(axis=1))
    assert got["w.global_scale"].tobytes() == want["w"].global_scales.tobytes()
    assert got["w.global_scale_inv"].tobytes() == want["w"].global_scale_invs.tobytes()
    assert got["w.block_scale"].tobytes() == want["w"].block_scales.tobytes()
    assert got["x.global_amax"].shape == ()
    with safe_open(py, framework="numpy") as f:
        qs = {q["name"]: q for q in json.loads(f.metadata()["amaxd.quantizers"])}
    assert qs["w"]["global_axes"] == 1 and "global_axes" not in qs["x"]
