"""amaxctl against a running daemon."""
import json
import os
import subprocess

import amaxd

CTL = os.environ.get("AMAXCTL_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build", "amaxctl"))


def ctl(d, *args):
    return subprocess.run([CTL, "--socket", d.socket, *args], capture_output=True, text=True, timeout=30)


def test_amaxctl(daemon):
    with daemon.client("cli", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("fc1.w", [3], amaxd.Recipe.fp8_current())])
        c.send({"fc1.w": [1.0, 2.0, 4.0]})
        c.reconcile()
    p = ctl(daemon, "--json", "status")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["backend"] == os.environ.get("AMAXD_BACKEND", "host") and st["jobs"][0]["name"] == "cli"
    assert st["jobs"][0]["reconciled_epochs"] == 1 and st["config"]["socket"] == daemon.socket
    p = ctl(daemon, "--json", "list")
    assert json.loads(p.stdout)[0]["global_shape"] == [3]
    p = ctl(daemon, "--json", "dump", "cli", "fc1.w")
    dump = json.loads(p.stdout)
    assert dump["amax"] == [1.0, 2.0, 4.0] and dump["scale"] == [448.0, 224.0, 112.0]
    p = ctl(daemon, "dump", "fc1.w")
    assert p.returncode == 0 and "global_amax 4" in p.stdout
    assert ctl(daemon, "health").stdout.strip() == "SERVING"
    p = ctl(daemon, "--json", "dump", "cli", "nope")
    assert p.returncode == 1 and json.loads(p.stdout)["error"] == "NOT_FOUND"
    assert ctl(daemon, "frobnicate").returncode == 2


def test_amaxctl_unreachable(tmp_path):
    p = subprocess.run([CTL, "--socket", str(tmp_path / "none.sock"), "--timeout", "1", "status"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and ("UNAVAILABLE" in p.stderr or "DEADLINE_EXCEEDED" in p.stderr)
