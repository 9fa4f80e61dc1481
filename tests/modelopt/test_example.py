"""client/python/examples/modelopt_tp.py, the runnable example of
docs/MODELOPT.md and the README, runs against a real daemon."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("modelopt.torch.quantization")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "e2e"))
from amaxd_proc import Daemon  # noqa: E402

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python",
                       "examples", "modelopt_tp.py")


def test_example_runs(tmp_path):
    d = Daemon(str(tmp_path))
    try:
        p = subprocess.run([sys.executable, EXAMPLE], env={**os.environ, "AMAXD_SOCKET": d.socket},
                           capture_output=True, text=True, timeout=300)
    finally:
        d.check_clean_exit(d.stop())
    assert p.returncode == 0, p.stdout + p.stderr
    assert "both ranks hold the single-process amax" in p.stdout
    assert "down_proj.input_quantizer" in p.stdout
