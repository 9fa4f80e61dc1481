"""The Prometheus endpoint: scraped over real HTTP from libmicrohttpd and
parsed with prometheus_client's parser, before and after known traffic."""
import http.client
import os
import re
import subprocess
import threading

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import amaxd
from amaxd import placement as P
from amaxd_proc import BIN


def port_of(d):
    m = re.search(r"serving Prometheus metrics on \S+ port (\d+)", d.log())
    assert m, d.log()
    return int(m.group(1))


def http_req(port, method="GET", path="/metrics", body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request(method, path, body=body)
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    return r, data


def scrape(port):
    r, text = http_req(port)
    assert r.status == 200, text
    assert r.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {}
    for f in fams.values():
        for s in f.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return fams, samples, text


def val(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def mdaemon(start_daemon):
    return start_daemon("--metrics-listen=127.0.0.1:0")


def test_scrape_after_traffic(mdaemon):
    port = port_of(mdaemon)
    fams, s, text = scrape(port)
    # HELP and TYPE for every family; names follow the conventions.
    for f in fams.values():
        assert f.name.startswith("amaxd_") and f.documentation, f.name
        assert f"# TYPE {f.name}" in text
    assert fams["amaxd_job_reconcile_seconds"].type == "histogram"
    assert fams["amaxd_job_epochs"].type == "counter"  # amaxd_job_epochs_total
    version = subprocess.run([BIN, "--version"], capture_output=True, text=True).stdout.split()[1]
    assert val(s, "amaxd_build_info", version=version, backend=os.environ.get("AMAXD_BACKEND", "host"),
               collective="local") == 1
    assert s[("amaxd_resident_memory_bytes", ())] > 1e6
    assert s[("amaxd_jobs", ())] == 0
    assert not [k for k in s if k[0].startswith("amaxd_job_")]

    # Known traffic: one rank, a per-expert quantizer of 4 experts in a peer
    # group (experts 1 and 3 get no tokens: filled from the group), and a
    # per-channel one with no peer group (one cell without data: missing).
    experts = amaxd.Quantizer("moe.fc2.input", [4], amaxd.Recipe.fp8_current(),
                              P.per_expert(4, 0, 1), peer_group="moe.fc2")
    chan = amaxd.Quantizer("fc1.weight", [3], amaxd.Recipe.fp8_current())
    e_vals = np.ma.masked_array([2.0, 0.0, 5.0, 0.0], mask=[False, True, False, True])
    c_vals = np.ma.masked_array([1.0, 0.0, 4.0], mask=[False, True, False])
    with mdaemon.client("mx", 0, 1) as c:
        c.join()
        c.register([experts, chan])
        c.send({"moe.fc2.input": e_vals, "fc1.weight": c_vals})
        res = c.reconcile()
        # 4 and 3 float32 values, one has_data byte per cell.
        sent_bytes = (4 * 4 + 4) + (3 * 4 + 3)
        _, s, _ = scrape(port)
        assert val(s, "amaxd_job_epochs_total", job="mx") == 1
        assert val(s, "amaxd_job_last_epoch", job="mx") == 1
        assert val(s, "amaxd_job_epochs_failed_total", job="mx") == 0
        assert val(s, "amaxd_job_updates_total", job="mx") == 2
        assert val(s, "amaxd_job_received_bytes_total", job="mx") == sent_bytes
        assert val(s, "amaxd_job_last_epoch_peer_filled_cells", job="mx") == 2
        assert val(s, "amaxd_job_last_epoch_missing_cells", job="mx") == 1
        assert val(s, "amaxd_job_quantizers", job="mx") == 2
        assert val(s, "amaxd_job_cells", job="mx") == 7
        assert val(s, "amaxd_job_reconcile_seconds_count", job="mx") == 1
        assert val(s, "amaxd_job_reconcile_seconds_bucket", job="mx", le="+Inf") == 1
        buckets = sorted((float(dict(k[1])["le"]), v) for k, v in s.items()
                         if k[0] == "amaxd_job_reconcile_seconds_bucket")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
        assert val(s, "amaxd_jobs") == 1
        assert val(s, "amaxd_requests_total", method="/amaxd.v1.Calibration/Reconcile",
                   code="OK") == 1
        # The same cells as the answer says.
        assert res["moe.fc2.input"].peer_filled.tolist() == [False, True, False, True]
        assert res["fc1.weight"].missing == 1

        # Refused requests, by code: NaN amax, an unknown quantizer.
        with pytest.raises(amaxd.errors.InvalidArgument):
            c.send({"fc1.weight": [float("nan"), 1.0, 1.0]})
        with pytest.raises(amaxd.errors.NotFound):
            c.send({"nope": [1.0]})
        # Epoch 2: every expert has data now.
        c.send({"moe.fc2.input": [1.0, 1.0, 1.0, 1.0], "fc1.weight": [1.0, 1.0, 1.0]})
        c.reconcile()
        _, s, _ = scrape(port)
        assert val(s, "amaxd_job_epochs_total", job="mx") == 2
        assert val(s, "amaxd_job_last_epoch", job="mx") == 2
        assert val(s, "amaxd_job_updates_total", job="mx") == 4  # refused ones not counted
        assert val(s, "amaxd_job_received_bytes_total", job="mx") == sent_bytes + 7 * 4
        assert val(s, "amaxd_job_last_epoch_peer_filled_cells", job="mx") == 0
        assert val(s, "amaxd_job_peer_filled_cells_total", job="mx") == 2
        assert val(s, "amaxd_job_last_epoch_missing_cells", job="mx") == 0
        assert val(s, "amaxd_job_reconcile_seconds_count", job="mx") == 2
        assert val(s, "amaxd_requests_refused_total", method="/amaxd.v1.Calibration/SendAmax",
                   code="INVALID_ARGUMENT") == 1
        assert val(s, "amaxd_requests_refused_total", method="/amaxd.v1.Calibration/SendAmax",
                   code="NOT_FOUND") == 1
        assert val(s, "amaxd_requests_total", method="/amaxd.v1.Calibration/SendAmax",
                   code="OK") == 2
        # A method the daemon does not have: counted under one label.
        with mdaemon.channel() as ch:
            with pytest.raises(grpc.RpcError) as e:
                ch.unary_unary('/x"y\\z.Svc/Nope')(b"", timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        _, s, _ = scrape(port)
        assert val(s, "amaxd_requests_refused_total", method="unknown", code="UNIMPLEMENTED") == 1
        c.reset(drop_job=True)
    # A dropped job's series are gone.
    _, s, _ = scrape(port)
    assert not [k for k in s if k[0].startswith("amaxd_job_")]
    assert val(s, "amaxd_jobs") == 0


def test_http_errors(mdaemon):
    port = port_of(mdaemon)
    r, body = http_req(port, path="/nope")
    assert r.status == 404 and "/metrics" in body
    r, body = http_req(port, "POST", "/metrics", body=b"x" * 1000)
    assert r.status == 405 and r.getheader("Allow") == "GET, HEAD"
    r, body = http_req(port, "DELETE", "/metrics")
    assert r.status == 405
    r, body = http_req(port, "HEAD", "/metrics")
    assert r.status == 200 and body == ""
    r, body = http_req(port, path="/")
    assert r.status == 200 and "/metrics" in body
    # Still serving after all that.
    _, s, _ = scrape(port)
    assert s[("amaxd_scrapes_total", ())] >= 2


def test_scrapes_during_traffic(mdaemon):
    """Scrapes from a thread while epochs run: the HTTP thread and the loop
    share only the metrics' mutex (ASan/UBSan builds run this too)."""
    port = port_of(mdaemon)
    stop = threading.Event()
    errors, count = [], [0]

    def scraper():
        while not stop.is_set():
            try:
                scrape(port)
                count[0] += 1
            except Exception as e:  # noqa: BLE001
                errors.append(e)
                return

    t = threading.Thread(target=scraper)
    t.start()
    try:
        with mdaemon.client("busy", 0, 1) as c:
            c.join()
            c.register([amaxd.Quantizer(f"q{i}", [8], amaxd.Recipe.fp8_current())
                        for i in range(16)])
            for e in range(20):
                c.send({f"q{i}": np.full(8, float(e + 1)) for i in range(16)})
                c.reconcile()
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    assert count[0] > 0
    _, s, _ = scrape(port)
    assert val(s, "amaxd_job_epochs_total", job="busy") == 20
    assert val(s, "amaxd_job_updates_total", job="busy") == 20 * 16


def test_remote_address_needs_permission(start_daemon):
    with pytest.raises(RuntimeError, match="not a loopback address"):
        start_daemon("--metrics-listen=0.0.0.0:0")
    d = start_daemon("--metrics-listen=0.0.0.0:0", "--metrics-allow-remote")
    _, s, _ = scrape(port_of(d))
    assert s[("amaxd_jobs", ())] == 0


def test_bad_listen_address(start_daemon):
    with pytest.raises(RuntimeError, match="is not host:port"):
        start_daemon("--metrics-listen=9464")


def test_off_by_default(daemon):
    assert "Prometheus" not in daemon.log()
