#!/usr/bin/env python3
"""Python client -> amaxd throughput over the Unix socket.

Starts the daemon (AMAXD_BIN, default build/amaxd) on a temporary socket and
measures, each as the median of --repeat runs:
  unary   SendAmax calls/s (one scalar update per call), one client thread,
          against the floor of the same loop of grpc.health.v1 Check calls
          (same transport, no work in the daemon);
  stream  StreamAmax MB/s of float32 payload in 1 MiB messages (serialized
          once beforehand), against the floor of writing the same bytes into
          a pipe drained by cat (a kernel copy, no gRPC, no daemon).
Prints a table; nothing is asserted.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

import amaxd
from amaxd import pb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(bin_path, sock, extra=()):
    p = subprocess.Popen([bin_path, f"--socket={sock}", "--log-level=warn", *extra])
    for _ in range(200):
        if os.path.exists(sock):
            return p
        time.sleep(0.05)
    raise RuntimeError("daemon did not start")


def timed(fn, n):
    t = time.perf_counter()
    fn(n)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--stream-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="extra daemon flag, e.g. --daemon-arg=--socket-guard=false")
    args = ap.parse_args()
    bin_path = os.environ.get("AMAXD_BIN", os.path.join(ROOT, "build", "amaxd"))
    tmp = tempfile.mkdtemp()
    sock = os.path.join(tmp, "amaxd.sock")
    proc = start(bin_path, sock, args.daemon_arg)
    cells = 1 << 18  # 1 MiB of float32 per message
    try:
        with amaxd.Client("bench", 0, 1, socket=sock) as c:
            c.join()
            c.register([amaxd.Quantizer("s", [], amaxd.Recipe.fp8_current()),
                        amaxd.Quantizer("big", [cells], amaxd.Recipe.fp8_current())])
            ch = grpc.insecure_channel("unix:" + sock)
            send = ch.unary_unary("/amaxd.v1.Calibration/SendAmax")
            health = ch.unary_unary("/grpc.health.v1.Health/Check")
            stream = ch.stream_unary("/amaxd.v1.Calibration/StreamAmax")
            small = pb.SendAmaxRequest(job="bench", rank=0, updates=[
                pb.AmaxUpdate(name="s", values=np.float32(1.5).tobytes())]).SerializeToString()
            vals = np.abs(np.random.default_rng(0).standard_normal(cells)).astype(np.float32)
            big = pb.SendAmaxRequest(job="bench", rank=0, updates=[
                pb.AmaxUpdate(name="big", values=vals.tobytes())])
            nmsg = args.stream_mb

            def unary(n):
                for _ in range(n):
                    send(small, timeout=10)

            def floor_unary(n):
                for _ in range(n):
                    health(b"", timeout=10)

            blob = big.SerializeToString()

            def streamed(n):
                r = pb.SendAmaxResponse.FromString(stream(iter([blob] * n), timeout=600))
                assert r.accepted == n

            def serialize_only(n):
                cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
                for _ in range(n):
                    cat.stdin.write(blob)
                cat.stdin.close()
                cat.wait()

            unary(200), floor_unary(200), streamed(4)  # warm-up
            res = {k: [] for k in ("unary", "health", "stream", "serialize")}
            for _ in range(args.repeat):
                res["unary"].append(args.calls / timed(unary, args.calls))
                res["health"].append(args.calls / timed(floor_unary, args.calls))
                res["stream"].append(nmsg * cells * 4 / 1e6 / timed(streamed, nmsg))
                res["serialize"].append(nmsg * cells * 4 / 1e6 / timed(serialize_only, nmsg))
            ch.close()
    finally:
        proc.terminate()
        proc.wait(30)
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"amaxd client throughput, Python grpcio {grpc.__version__}, Unix socket, "
          f"median of {args.repeat} runs ({os.cpu_count()} CPUs); daemon flags: "
          f"{' '.join(args.daemon_arg) or '(defaults)'}")
    print(f"{'measure':<34}{'value':>14}{'floor':>14}{'ratio':>8}")
    print(f"{'unary SendAmax (1 scalar), calls/s':<34}{med['unary']:>14.0f}{med['health']:>14.0f}"
          f"{med['unary'] / med['health']:>8.2f}")
    print(f"{'StreamAmax 1 MiB messages, MB/s':<34}{med['stream']:>14.1f}{med['serialize']:>14.1f}"
          f"{med['stream'] / med['serialize']:>8.2f}")
    print("floor: unary = grpc.health.v1 Check on the same channel; "
          "stream = the same bytes through a pipe to cat")
    return 0


if __name__ == "__main__":
    sys.exit(main())
