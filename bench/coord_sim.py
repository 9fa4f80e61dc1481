"""The coordinator under many member daemons, simulated from one process
(issue 24; docs/CLUSTER.md, "What agreement costs").

A real amaxd runs as the coordinator (cluster rank 0, host backend, hosting
no rank). This script plays N member daemons 1..N, one trainer rank each,
speaking the peer protocol (proto/amaxd/peer/v1/peer.proto) with the
cluster's HMAC tokens, as a daemon's engine does: N Joins; the first
agreement of N identical catalogs of Q per-tensor quantizers (each member
offers them by hash; the one the coordinator asks sends them); the Gloo
rendezvous as the members would run it (ring: each sets its key and reads
its two neighbours'; and, for small N, gloo's full mesh for comparison);
then one quantizer added by one member (a second agreement round),
--changes times, a new one each time (after --idle seconds each). It
prints what the coordinator spent on each step: wall time, its CPU time
(the process's CPU clock, clock_gettime of its pid's CPUCLOCK_SCHED:
nanoseconds, every thread, those that ended too; the 10 ms ticks of
/proc/<pid>/stat beside it), its resident memory, the bytes sent and
received (the serialized messages), and its own counters
(Status.coordinator_status).

The members' catalog hashes are the daemon's own (a helper amaxd, not in
the cluster, agrees each catalog for a job of one rank; Status gives its
hash): nothing here re-implements the daemon's hashing of specs.

    python bench/coord_sim.py --amaxd build/amaxd --members 8,64,1000 --quantizers 100000

Not a CI test: N = 1,000 and Q = 100k take minutes on a 2-core machine.
"""
import argparse
import asyncio
import hashlib
import hmac
import importlib.util
import os
import random
import socket
import struct
import subprocess
import sys
import tempfile
import time

import grpc

import amaxd
from amaxd._gen import amaxd_pb2 as apb

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from amaxd_proc import Daemon  # noqa: E402

SVC = "/amaxd.peer.v1.Peer/"
GLOO_ADDR = 136  # bytes of one gloo tcp address (sockaddr_storage + a sequence number)


def load_peer_pb():
    """peer_pb2 generated now from the repository's proto, importing the
    client's amaxd_pb2 (the same file descriptor, registered once)."""
    from grpc_tools import protoc
    out = tempfile.mkdtemp(prefix="amaxd-sim-pb-")
    rc = protoc.main(["protoc", f"-I{ROOT}/proto", f"--python_out={out}",
                      "amaxd/peer/v1/peer.proto"])
    if rc != 0:
        sys.exit("protoc failed on proto/amaxd/peer/v1/peer.proto")
    path = os.path.join(out, "amaxd", "peer", "v1", "peer_pb2.py")
    src = open(path).read().replace("from amaxd.v1 import amaxd_pb2",
                                    "from amaxd._gen import amaxd_pb2")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("amaxd_sim_peer_pb2", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fnv(h, b):
    for x in b:
        h = ((h ^ x) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def membership_hash(world, parts):
    """daemon/coord.c amx_membership_hash, over a JoinResponse's participants."""
    h = fnv(0xcbf29ce484222325, struct.pack("<II", world, len(parts)))
    for p in parts:
        h = fnv(h, struct.pack("<IQ", p.daemon, p.incarnation))
        h = fnv(h, p.address.encode() + b"\0")
        h = fnv(h, struct.pack("<I", len(p.ranks)) + b"".join(struct.pack("<I", r) for r in p.ranks))
    return h


def names(q):
    return [f"model.layers.{i // 8:05d}.q{i % 8}.input_quantizer" for i in range(q)]


def new_name(k):
    """The k-th quantizer added (k = 0, 1, ...): names that sort among the
    catalog's (the worst case for a daemon's layout, a remap), the first
    one after all of them."""
    return "zz.added.weight_quantizer" if k == 0 else f"model.layers.{k:05d}.added{k}"


def catalog_hashes(amaxd_bin, q, changes, tmp):
    """The agreed-catalog hashes of: no quantizer ("empty"), the Q ("cat"),
    then after each of `changes` quantizers added one at a time ("union",
    a list), and of each added one alone ("new", a list); from a helper
    daemon (jobs of one rank)."""
    os.makedirs(os.path.join(tmp, "helper"), exist_ok=True)
    d = Daemon(os.path.join(tmp, "helper"), "--max-queued-bytes=4294967296", "--log-level=info",
               socket=os.path.join(tmp, "helper.sock"))
    out = {"union": [], "new": []}

    def agreed(c, job, ns):
        if ns:
            c.register([amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current()) for n in ns])
        c.reconcile(names=ns[:1])
        return c.status(job).jobs[0].catalog_hash

    def client(job):
        c = amaxd.Client(job, 0, 1, socket=d.socket, timeout=600)
        c.join()
        return c
    try:
        c = client("hempty")
        out["empty"] = agreed(c, "hempty", [])
        c.close()
        c = client("hcat")
        out["cat"] = agreed(c, "hcat", names(q))
        for k in range(changes):
            out["union"].append(agreed(c, "hcat", [new_name(k)]))
        c.close()
        for k in range(changes):
            c = client(f"hnew{k}")
            out["new"].append(agreed(c, f"hnew{k}", [new_name(k)]))
            c.close()
    finally:
        d.check_clean_exit(d.stop())
    return out


def specs(ns):
    return [amaxd.Quantizer(n, [], amaxd.Recipe.fp8_current()).to_pb() for n in ns]


def proc_ticks(pid):
    """CPU seconds in the 10 ms ticks of /proc/<pid>/stat (utime + stime)."""
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    """CPU seconds of the whole process to the nanosecond: the clock
    clock_getcpuclockid(pid) gives (Linux: ((~pid) << 3) | CPUCLOCK_SCHED),
    which counts every thread, those that ended too. Where it cannot be
    read, the sum of /proc/<pid>/task/*/schedstat (live threads only)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except OSError:
        total = 0
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9


def proc_mem(pid):
    m = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                m[k] = int(v.split()[0]) * 1024
    return m


class Members:
    """N simulated member daemons over a few channels to the coordinator."""

    def __init__(self, pb, addr, secret, n, q, hashes, channels=16):
        self.pb, self.secret, self.n, self.q, self.h = pb, secret, n, q, hashes
        self.chans = [grpc.aio.insecure_channel(
            addr, options=[("grpc.max_receive_message_length", -1),
                           ("grpc.max_send_message_length", -1)]) for _ in range(channels)]
        self.inc = [random.getrandbits(64) for _ in range(n + 1)]
        self.bytes_out = 0  # to the coordinator
        self.bytes_in = 0   # from it
        self.world = n

    def token(self, method):
        now = int(time.time())
        mac = hmac.new(self.secret, f"{now}:{method}".encode(), hashlib.sha256).hexdigest()
        return f"{now}:{mac}"

    async def call(self, d, method, req, resp_type, timeout=600):
        ch = self.chans[d % len(self.chans)]
        path = SVC + method
        data = req.SerializeToString()
        self.bytes_out += len(data)
        raw = await ch.unary_unary(path, request_serializer=None, response_deserializer=None)(
            data, timeout=timeout, metadata=[("x-amaxd-auth", self.token(path))])
        self.bytes_in += len(raw)
        r = resp_type()
        r.ParseFromString(raw)
        return r

    def addr(self, d):
        return f"127.0.0.1:{20000 + d}"

    async def join(self, d):
        pb = self.pb
        r = await self.call(d, "Join", pb.JoinRequest(
            job="sim", world_size=self.world, rank=d - 1, daemon=d, incarnation=self.inc[d],
            address=self.addr(d), timeout_ms=600000), pb.JoinResponse)
        return r

    async def sync(self, d, catalog_hash, union_hash, offer, offer_hash, mhash, last, need_comm,
                   inline_max=32):
        """One member's agreement, as engine_agree.c runs it: the offer by
        hash (inline when small), again with the specs when asked."""
        pb = self.pb
        included = 0 < len(offer) <= inline_max
        rounds = 0
        while True:
            rounds += 1
            req = pb.SyncRequest(
                job="sim", daemon=d, incarnation=self.inc[d], last_reconciled=last,
                catalog_hash=catalog_hash, need_comm=need_comm, timeout_ms=600000,
                world_size=self.world, ranks=[d - 1], address=self.addr(d),
                offer_hash=offer_hash if offer else 0, offer_count=len(offer),
                offer_included=included, membership_hash=mhash, union_hash=union_hash)
            if included:
                req.proposals.extend(offer)
            r = await self.call(d, "Sync", req, pb.SyncResponse)
            if r.send_offer and not included:
                included = True
                continue
            if r.send_catalog or r.send_offer:
                raise RuntimeError(f"member {d}: the coordinator asked again ({r})")
            return r, rounds

    async def kv_set(self, d, key, value):
        await self.call(d, "KvSet", self.pb.KvSetRequest(key=key, value=value),
                        self.pb.KvSetResponse)

    async def kv_get(self, d, key):
        r = await self.call(d, "KvGet", self.pb.KvGetRequest(key=key, timeout_ms=600000),
                            self.pb.KvGetResponse)
        return r.value

    async def close(self):
        for c in self.chans:
            await c.close()


class Meter:
    def __init__(self, pid, m):
        self.pid, self.m = pid, m

    def __enter__(self):
        self.t0, self.c0, self.k0 = time.monotonic(), proc_cpu(self.pid), proc_ticks(self.pid)
        self.o0, self.i0 = self.m.bytes_out, self.m.bytes_in
        return self

    def __exit__(self, *a):
        self.wall = time.monotonic() - self.t0
        self.cpu = proc_cpu(self.pid) - self.c0
        self.ticks = proc_ticks(self.pid) - self.k0
        self.sent_to = self.m.bytes_out - self.o0      # bytes the coordinator received
        self.recv_from = self.m.bytes_in - self.i0     # bytes it sent
        self.mem = proc_mem(self.pid)


def fmt_b(n):
    for u in ("B", "KB", "MB", "GB"):
        if n < 1000 or u == "GB":
            return f"{n:.1f} {u}" if u != "B" else f"{n} B"
        n /= 1000.0


async def run_one(args, pb, n, q, hashes, amaxd_bin, tmp):
    port = free_port()
    secret = os.urandom(32)
    sp = os.path.join(tmp, f"secret-{n}")
    with open(sp, "wb") as f:
        f.write(secret)
    os.chmod(sp, 0o600)
    os.makedirs(os.path.join(tmp, f"coord-{n}"), exist_ok=True)
    d = Daemon(os.path.join(tmp, f"coord-{n}"), f"--cluster-size={n + 1}", "--cluster-rank=0",
               f"--coordinator=127.0.0.1:{port}", f"--peer-listen=127.0.0.1:{port}",
               f"--peer-advertise=127.0.0.1:{port}", f"--cluster-secret-file={sp}",
               "--collective=gloo", "--backend=host", "--log-level=info",
               socket=os.path.join(tmp, f"coord-{n}.sock"))
    pid = d.proc.pid
    if args.pin:
        # Every thread of the coordinator on the first CPU, this process on
        # the others: the members do not take the coordinator's CPU.
        for t in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(t), {0})
    rows = []
    m = Members(pb, f"127.0.0.1:{port}", secret, n, q, hashes)
    try:
        base = proc_mem(pid)["VmRSS"]
        with Meter(pid, m) as mt:
            joins = await asyncio.gather(*(m.join(i) for i in range(1, n + 1)))
        rows.append(("join", mt))
        parts = joins[0].participants
        mh = membership_hash(n, parts)
        cat = specs(names(q))
        with Meter(pid, m) as mt:
            res = await asyncio.gather(*(m.sync(i, hashes["empty"], hashes["cat"], cat, hashes["cat"],
                                                mh, 0, True) for i in range(1, n + 1)))
        rows.append(("first agreement", mt))
        first = [r for r, _ in res]
        assert all(r.catalog_hash == hashes["cat"] for r in first), "a member got another catalog"
        assert all(r.catalog_yours or not r.catalog_included for r in first)
        gen, inc = first[0].comm_generation, first[0].coordinator_incarnation
        asked = sum(k > 1 for _, k in res)
        mem_first = mt.mem

        # The Gloo rendezvous of the new communicator, as comm_gloo.cc's
        # RingContext runs it: set your key, read your two neighbours'.
        prefix = f"comm/sim/{inc:016x}/{gen}/"
        addr = bytes(2 * GLOO_ADDR)

        async def ring(i):
            r = i - 1
            await m.kv_set(i, prefix + str(r), addr)
            for p in sorted({(r - 1) % n, (r + 1) % n} - {r}):
                await m.kv_get(i, prefix + str(p))
        with Meter(pid, m) as mt:
            await asyncio.gather(*(ring(i) for i in range(1, n + 1)))
        rows.append(("rendezvous, ring (now)", mt))
        if n <= args.mesh_max:
            # gloo's connectFullMesh (before): N-1 addresses per key, every
            # rank reads every other key.
            mesh = bytes((n - 1) * GLOO_ADDR)
            prefix2 = prefix + "mesh/"

            async def full(i):
                r = i - 1
                await m.kv_set(i, prefix2 + str(r), mesh)
                for p in range(n):
                    if p != r:
                        await m.kv_get(i, prefix2 + str(p))
            with Meter(pid, m) as mt:
                await asyncio.gather(*(full(i) for i in range(1, n + 1)))
            rows.append(("rendezvous, full mesh (before)", mt))

        # One member adds one quantizer: every member comes to the barrier
        # (the header told them), only member 1 with an offer. Again with
        # another quantizer, --changes times.
        before = hashes["cat"]
        for k in range(args.changes):
            one = specs([new_name(k)])
            after = hashes["union"][k]
            if args.idle > 0:
                await asyncio.sleep(args.idle)
            with Meter(pid, m) as mt:
                res = await asyncio.gather(*(
                    m.sync(i, before, after if i == 1 else before,
                           one if i == 1 else [], hashes["new"][k], mh, 1 + k, False)
                    for i in range(1, n + 1)))
            rows.append((f"one quantizer added ({k + 1})", mt))
            second = [r for r, _ in res]
            assert all(r.catalog_hash == after for r in second)
            assert all(r.catalog_yours or len(r.catalog) == 1 for r in second), \
                "an answer carried more than the one new spec"
            before = after
        admin = amaxd.Client("admin", 0, 1, socket=d.socket, timeout=60)
        cs = admin.status("").coordinator_status
        admin.close()
        await asyncio.sleep(0.5)
        mem_end = proc_mem(pid)
    finally:
        await m.close()
        d.check_clean_exit(d.stop())
    return rows, base, mem_first, asked, cs, mem_end


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--amaxd", required=True)
    ap.add_argument("--members", default="8,64,1000", help="comma-separated N")
    ap.add_argument("--quantizers", default="100000", help="comma-separated Q")
    ap.add_argument("--changes", type=int, default=3,
                    help="how many times one quantizer is added (a new one each time)")
    ap.add_argument("--idle", type=float, default=0,
                    help="seconds to wait before each change: past 2 s the coordinator has given "
                         "its free memory back (daemon/main.c, trim_when_idle), as it has after "
                         "a while of steady epochs, which do not reach it")
    ap.add_argument("--pin", action="store_true",
                    help="the coordinator on CPU 0, this simulator on the other CPUs")
    ap.add_argument("--mesh-max", type=int, default=128,
                    help="largest N for which gloo's full-mesh rendezvous is simulated too")
    args = ap.parse_args()
    import amaxd_proc
    amaxd_proc.BIN = os.path.abspath(args.amaxd)
    if args.pin:
        os.sched_setaffinity(0, set(range(1, os.cpu_count())))
    pb = load_peer_pb()
    tmp = tempfile.mkdtemp(prefix="amaxd-sim-")
    print(f"# coord_sim: amaxd {args.amaxd}; {os.cpu_count()} CPUs; one coordinator, "
          "N simulated members, Q per-tensor quantizers each (identical catalogs)")
    print("| N | Q | step | wall | coordinator CPU | (in 10 ms ticks) | coordinator in | "
          "coordinator out | RSS after |")
    print("|---|---|---|---|---|---|---|---|---|")
    summary = []
    for q in [int(x) for x in args.quantizers.split(",")]:
        hashes = catalog_hashes(args.amaxd, q, args.changes, tmp)
        cat_bytes = sum(s.ByteSize() for s in specs(names(q)))
        for n in [int(x) for x in args.members.split(",")]:
            rows, base, mem_first, asked, cs, mem_end = asyncio.run(run_one(args, pb, n, q, hashes,
                                                                   args.amaxd, tmp))
            for step, mt in rows:
                print(f"| {n} | {q} | {step} | {mt.wall * 1e3:.0f} ms | {mt.cpu * 1e3:.1f} ms | "
                      f"{mt.ticks * 1e3:.0f} ms | "
                      f"{fmt_b(mt.sent_to)} | {fmt_b(mt.recv_from)} | "
                      f"{mt.mem['VmRSS'] / 1e6:.1f} MB |", flush=True)
            summary.append((n, q, base, mem_first, asked, cs, cat_bytes, mem_end))
    print()
    print("| N | Q | RSS at start | RSS after first agreement | at the end (peak) | "
          "one catalog on the wire | offers asked | specs received | specs sent | "
          "answers built | answer bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, q, base, mem, asked, cs, cb, me in summary:
        print(f"| {n} | {q} | {base / 1e6:.1f} MB | {mem['VmRSS'] / 1e6:.1f} MB | "
              f"{me['VmRSS'] / 1e6:.1f} MB ({me['VmHWM'] / 1e6:.1f} MB) | {fmt_b(cb)} | "
              f"{cs.offers_asked} | "
              f"{cs.specs_received} | {cs.specs_sent} | {cs.answers_built} | "
              f"{fmt_b(cs.answer_bytes)} |")


if __name__ == "__main__":
    main()
