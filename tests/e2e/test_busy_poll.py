"""busy_poll (docs/OPERATING.md "Busy polling"): with it on, the engine
thread spins for an epoch the loop is about to hand over and the loop
polls for an epoch's end, each for 2 ms at most. Epochs are reconciled as
with it off (same scales, two ranks, previous globals), and nothing spins
between epochs: the idle daemon's CPU time stays near zero (a thread left
spinning would take a whole core). A value that is not auto|on|off stops
the start with the setting named."""
import os
import subprocess
import threading
import time

import numpy as np

import amaxd

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def run_epochs(d, job, epochs):
    out = [None, None]

    def rank(r):
        with d.client(job, r, 2) as c:
            c.join()
            c.register([amaxd.Quantizer("w", [4], amaxd.Recipe.fp8_current()),
                        amaxd.Quantizer("x", [], amaxd.Recipe.nvfp4())])
            got = []
            for e in range(epochs):
                c.send({"w": np.arange(4, dtype=np.float32) * (r + 1) + e, "x": 2.0 * e + r})
                res = c.reconcile()
                got.append((res["w"].amax.tobytes(), res["w"].scale.tobytes(),
                            float(res["x"].global_amax),
                            res["x"].previous_global_amax))
            out[r] = got
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert out[0] is not None and out[1] is not None
    assert out[0] == out[1], "the ranks were answered different scales"
    return out[0]


def test_busy_poll_on_same_answers_and_idle_when_idle(start_daemon):
    on = start_daemon("--busy-poll=on")
    off = start_daemon("--busy-poll=off")
    a = run_epochs(on, "bp", 30)
    b = run_epochs(off, "bp", 30)
    assert a == b
    assert a[-1][2] == 2.0 * 29 + 1 and a[-1][3] == 2.0 * 28 + 1  # the global and the one before
    time.sleep(0.2)  # past every 2 ms window
    t0 = cpu_seconds(on.proc.pid)
    time.sleep(1.0)
    used = cpu_seconds(on.proc.pid) - t0
    assert used < 0.3, f"the idle daemon used {used:.2f} s of CPU in 1 s: something spins"
    assert "busy polling around epochs (busy_poll=on" in on.log()
    assert "busy polling" not in off.log()


def test_busy_poll_bad_value(tmp_path):
    p = subprocess.run([os.environ["AMAXD_BIN"], f"--socket={tmp_path}/s.sock",
                        "--busy-poll=sometimes"], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0
    assert "busy_poll" in p.stderr + p.stdout and "auto|on|off" in p.stderr + p.stdout
