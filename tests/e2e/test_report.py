"""amaxctl watch and amaxctl report against a daemon with a job whose
values are known: the report's HTML is checked against them and each of
its SVG charts is rendered to PNG (cairosvg) and checked for drawn pixels."""
import io
import json
import os
import re
import signal
import subprocess

import numpy as np
import pytest

import amaxd
from amaxd import placement as P

CTL = os.environ.get("AMAXCTL_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "build", "amaxctl"))

BLUE = (0x3B, 0x6F, 0xB6)    # bars
ORANGE = (0xE8, 0xA3, 0x3D)  # cold experts


def ctl(d, *args, **kw):
    return subprocess.run([CTL, "--socket", d.socket, *args], capture_output=True, text=True,
                          timeout=60, **kw)


def fc1(l):
    return f"decoder.layers.{l}.mlp.linear_fc1.weight_quantizer"


def experts(l):
    return f"decoder.layers.{l}.mlp.experts.linear_fc2.input_quantizer"


def qkv(l):
    return f"decoder.layers.{l}.self_attention.linear_qkv.input_quantizer"


HEAD = "lm_head.input_quantizer"


def calibrate(d, job="rep"):
    """Two epochs. Layer 0's experts 1 and 3 never get tokens (filled from
    their peer group's max, 5); qkv's amax of layer 0 goes 1 -> 8 (its
    scale moves by 2^-3), of layer 1 2 -> 3; lm_head's cell 1 never has data."""
    qs = []
    for l in range(2):
        qs += [amaxd.Quantizer(fc1(l), [4], amaxd.Recipe.fp8_current()),
               amaxd.Quantizer(experts(l), [4], amaxd.Recipe.fp8_current(), P.per_expert(4, 0, 1),
                               peer_group=f"layers.{l}.experts.fc2.input"),
               amaxd.Quantizer(qkv(l), [], amaxd.Recipe.fp8_current())]
    qs.append(amaxd.Quantizer(HEAD, [3], amaxd.Recipe.fp8_current()))
    cold = np.ma.masked_array([2.0, 0.0, 5.0, 0.0], mask=[False, True, False, True])
    with d.client(job, 0, 1) as c:
        c.join()
        c.register(qs)
        for qkv_vals in ([1.0, 2.0], [8.0, 3.0]):
            upd = {}
            for l in range(2):
                upd[fc1(l)] = np.array([1.0, 2.0, 3.0, 4.0]) * (l + 1)
                upd[experts(l)] = cold if l == 0 else np.array([1.0, 2.0, 3.0, 4.0])
                upd[qkv(l)] = qkv_vals[l]
            upd[HEAD] = np.ma.masked_array([1.0, 0.0, 0.5], mask=[False, True, False])
            c.send(upd)
            res = c.reconcile()
    return res


def test_report(daemon, tmp_path):
    res = calibrate(daemon)
    assert res[experts(0)].peer_filled.tolist() == [False, True, False, True]
    out = tmp_path / "report.html"
    p = ctl(daemon, "report", "rep", "-o", str(out))
    assert p.returncode == 0, p.stderr
    assert "epoch 2, 7 quantizers" in p.stderr
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert '<span id="job">rep</span>' in page
    assert '<dd id="epoch">2</dd>' in page and '<dd id="quantizers">7</dd>' in page

    # Self-contained: no script, nothing fetched, links only within the page.
    assert "<script" not in page and "src=" not in page and "@import" not in page
    assert all(h.startswith("#") for h in re.findall(r'href="([^"]*)"', page))
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}

    # Cold experts: layer 0's experts 1 and 3, filled with the group's max 5.
    assert 'id="cold-total">2<' in page
    cold_rows = re.findall(r'<tr class="cold-row">(.*?)</tr>', page)
    assert len(cold_rows) == 1
    cells = re.findall(r"<td[^>]*>(.*?)</td>", cold_rows[0])
    assert cells == [experts(0), "layers.0.experts.fc2.input", "1, 3", "4", "5"]

    # Scales that moved most: layer 0's qkv (scale 448 -> 56: log2 -3), then
    # layer 1's (448/2 -> 448/3); nothing else moved.
    movers = re.findall(r'<tr class="mover">(.*?)</tr>', page)
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", m) for m in movers]
    assert [r[1] for r in rows[:2]] == [qkv(0), qkv(1)]
    assert rows[0][2:] == ["fp8_e4m3", "1", "8", "448", "56", "-3.000"]
    assert rows[1][3:7] == ["2", "3", "224", "149.333"]
    assert float(rows[1][7]) == pytest.approx(np.log2(2 / 3), abs=1e-3)
    assert all(float(r[7]) == 0 for r in rows[2:])

    # Cells without data: lm_head's cell 1.
    assert 'id="missing-total">1<' in page
    assert re.findall(r'<tr class="missing-row"><td class="name">(.*?)</td><td>(\d+)</td>', page) \
        == [(HEAD, "1")]

    # Every quantizer with its global amax.
    gam = dict(re.findall(r'<tr class="q"><td class="name">(.*?)</td>.*?<td class="gamax">(.*?)</td>',
                          page))
    assert gam == {fc1(0): "4", fc1(1): "8", experts(0): "5", experts(1): "4", qkv(0): "8",
                   qkv(1): "3", HEAD: "1"}

    # Charts: 3 kinds over layers, 2 peer groups, the movers.
    svgs = re.findall(r"<svg .*?</svg>", page, re.S)
    assert len(svgs) == 6
    titles = [re.search(r'font-weight="bold"[^>]*>(.*?)</text>', s).group(1) for s in svgs]
    # (in the catalog's order: sorted by name)
    assert titles[:3] == ["decoder.layers.*.mlp.experts.linear_fc2.input_quantizer",
                          "decoder.layers.*.mlp.linear_fc1.weight_quantizer",
                          "decoder.layers.*.self_attention.linear_qkv.input_quantizer"]
    assert titles[3] == "layers.0.experts.fc2.input (4 experts)"
    # The layer-0 expert chart: 4 bars, the two cold ones orange.
    bars = re.findall(r'<rect x="[^"]+" y="[^"]+" width="[^"]+" height="[^"]+" fill="(#[0-9a-f]+)">',
                      svgs[3])
    assert bars == ["#3b6fb6", "#e8a33d", "#3b6fb6", "#e8a33d"]

    # The render needs cairosvg (and libcairo): in tests/requirements.txt on
    # the build machine; a GPU host image may lack them (tests/gpu/run.sh).
    cairosvg = pytest.importorskip("cairosvg")
    from PIL import Image
    for k, s in enumerate(svgs):
        png = cairosvg.svg2png(bytestring=s.encode())
        img = Image.open(io.BytesIO(png)).convert("RGB")
        assert img.size == (720, 260)
        px = np.asarray(img).reshape(-1, 3)
        drawn = np.any(px != 255, axis=1).mean()
        assert drawn > 0.01, f"chart {k} ({titles[k]}) is blank"
        colours = {tuple(c) for c in px}
        assert BLUE in colours, f"chart {k} ({titles[k]}) has no bars"
        if k == 3:
            assert ORANGE in colours, "cold experts not drawn"


def test_report_to_stdout_and_errors(daemon):
    calibrate(daemon, "solo")
    p = ctl(daemon, "report")  # the only job
    assert p.returncode == 0, p.stderr
    assert '<span id="job">solo</span>' in p.stdout
    p = ctl(daemon, "report", "nope")
    assert p.returncode == 1 and "NOT_FOUND" in p.stderr
    p = ctl(daemon, "report", "solo", "--frobnicate")
    assert p.returncode == 2


def test_report_html_escapes_names(daemon, tmp_path):
    name = 'layers.0.a<b>&"c\'.q'
    with daemon.client("esc", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer(name, [], amaxd.Recipe.fp8_current())])
        c.send({name: 2.0})
        c.reconcile()
    p = ctl(daemon, "report", "esc", "-o", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    page = (tmp_path / "r.html").read_text()
    assert name not in page
    assert "layers.0.a&lt;b&gt;&amp;&quot;c&#39;.q" in page


def test_watch_json_count(daemon):
    calibrate(daemon, "w1")
    p = ctl(daemon, "--json", "watch", "w1", "--interval", "0.05", "--count", "3")
    assert p.returncode == 0, p.stderr
    frames = [json.loads(l) for l in p.stdout.splitlines()]
    assert [f["refresh"] for f in frames] == [0, 1, 2]
    for f in frames:
        (j,) = f["jobs"]
        assert (j["name"], j["reconciled_epochs"], j["quantizers"], j["epoch"]) == ("w1", 2, 7, 3)
        assert j["updates"] == 14 and j["cells"] == 4 * 4 + 2 + 3


def test_watch_text(daemon):
    calibrate(daemon, "w2")
    p = ctl(daemon, "watch", "--interval", "0.05", "--count", "2")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("JOB ") == 2
    rows = [l.split() for l in p.stdout.splitlines() if l.startswith("w2 ")]
    assert len(rows) == 2 and rows[0][:7] == ["w2", "1", "1", "3", "2", "0", "7"]


def test_watch_ctrl_c(daemon):
    calibrate(daemon, "w3")
    w = subprocess.Popen([CTL, "--socket", daemon.socket, "--json", "watch", "--interval", "0.1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(w.stdout.readline())
        assert first["jobs"][0]["name"] == "w3"
        w.send_signal(signal.SIGINT)
        assert w.wait(30) == 0
        rest = w.stdout.read()
        assert all(json.loads(l)["jobs"] for l in rest.splitlines())  # whole lines only
    finally:
        if w.poll() is None:
            w.kill()


def test_watch_bad_args_and_unreachable(daemon, tmp_path):
    assert ctl(daemon, "watch", "--interval", "0").returncode == 2
    assert ctl(daemon, "watch", "--count", "x").returncode == 2
    assert ctl(daemon, "watch", "a", "b").returncode == 2
    p = subprocess.run([CTL, "--socket", str(tmp_path / "none.sock"), "--timeout", "1", "watch",
                        "--count", "1"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "UNAVAILABLE" in p.stdout or "DEADLINE" in p.stdout
