#!/usr/bin/env python3
"""Independent check of the previous-epoch globals (has_previous,
previous_global_amax, previous_global_scale) that amaxd answers carry.

Written from README.md, docs/API.md, docs/CLUSTER.md, docs/OPERATING.md only.

Model (docs/API.md, "Model"): for each quantizer, the answer of a reconciled
epoch carries has_previous = true and previous_global_{amax,scale} = the
global amax / scale that the same quantizer's answer carried in the job's
previous *reconciled* epoch; has_previous = false (previous values 0 in the
packed form, None in the named Result) in the quantizer's first reconciled
epoch.  A failed epoch reconciles nothing, so it does not move them.
GetScales answers the last reconciled result, so between epochs it carries
the same previous values as the last answer.  A daemon restored from its
snapshot (OPERATING.md "Durability": snapshot holds "each quantizer's global
amax and scale of the epoch before it (has_previous ...), so GetScales
answers after a restart exactly as before") and a daemon that caught up
from a peer (API.md "Job state format 5", CLUSTER.md) answer the same.

Run: AMAXD_BIN=build/amaxd .venv/bin/python tests/cluster/outside/prev_check.py
(host backend, no GPU; PREV_CHECK_DIR: where its daemons' logs and state go)
"""
import os
import tempfile
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import amaxd
from amaxd import errors as E
from amaxd.placement import Placement

AMAXD = os.environ.get("AMAXD_BIN", "build/amaxd")
BASE = os.environ.get("PREV_CHECK_DIR") or tempfile.mkdtemp(prefix="amaxd-prev-check-")
SHM = "/dev/shm/outside-prev-%d" % os.getpid()
RTO_MS = 3000  # reconcile_timeout_ms of every daemon (the failed-epoch checks)

PROCS = []
RESULTS = []  # (ok, check, line)


def log(s):
    print(s, flush=True)


def report(ok, check, msg):
    RESULTS.append((ok, check, msg))
    tag = {True: "PASS", False: "FAIL", None: "INFO"}[ok]
    log("%s [%s] %s" % (tag, check, msg))


def bits(x):
    return int(np.float32(x).view(np.uint32))


def f32(x):
    return float(np.float32(x))


# ---------------------------------------------------------------- daemons

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Daemon:
    def __init__(self, name, extra=(), state_dir=None):
        self.name = name
        self.dir = os.path.join(BASE, name)
        os.makedirs(self.dir, exist_ok=True)
        self.sock = os.path.join(self.dir, "d.sock")
        self.logf = os.path.join(self.dir, "daemon.log")
        self.state_dir = state_dir
        self.extra = list(extra)
        self.p = None

    def start(self, state_dir="keep"):
        if state_dir != "keep":
            self.state_dir = state_dir
        args = [AMAXD, "--backend=host", "--socket=" + self.sock,
                "--shm_dir=" + SHM, "--log_file=" + self.logf,
                "--busy_poll=off", "--reconcile_timeout_ms=%d" % RTO_MS,
                "--join_timeout_ms=20000", "--shutdown_grace_ms=500"]
        if self.state_dir:
            args.append("--state_dir=" + self.state_dir)
        args += self.extra
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                  stderr=open(os.path.join(self.dir, "stderr"), "ab"))
        PROCS.append(self.p)
        t0 = time.time()
        while time.time() - t0 < 20:
            if self.p.poll() is not None:
                raise RuntimeError("daemon %s exited %s" % (self.name, self.p.returncode))
            if os.path.exists(self.sock):
                try:
                    with amaxd.Client("probe", 0, 1, socket=self.sock, timeout=5) as c:
                        c.status()
                    return
                except Exception:
                    pass
            time.sleep(0.05)
        raise RuntimeError("daemon %s did not come up" % self.name)

    def kill9(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def stop(self):
        if self.p and self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


# ---------------------------------------------------------------- catalog

class Q:
    """A quantizer of the test catalog: spec + each rank's placement
    (None: the rank does not place it; "whole": no placement given;
    a Placement otherwise)."""

    def __init__(self, name, shape, recipe, acc=amaxd.PER_EPOCH, place=None,
                 mask=False, send_every=1, **kw):
        self.name, self.shape, self.recipe, self.acc = name, list(shape), recipe, acc
        self.place = place or {}
        self.mask = mask
        self.send_every = send_every
        self.kw = kw

    def quantizer(self, rank):
        pl = self.place.get(rank)
        return amaxd.Quantizer(self.name, self.shape, self.recipe,
                               None if pl == "whole" else pl,
                               accumulation=self.acc, **self.kw)

    def block_shape(self, rank):
        pl = self.place.get(rank)
        if pl == "whole":
            return tuple(self.shape)
        return tuple(pl.local_shape)


def base_catalog(world):
    """Registered in a shuffled order; names chosen so catalog (byte) order
    differs from registration order, ranks place different subsets."""
    R = amaxd.Recipe
    cat = []
    kinds = ["fp8cur", "nvfp4", "delayed", "rows", "slices", "running", "mx"]
    for i in range(14):
        k = kinds[i % len(kinds)]
        name = "layer%02d.%s" % ((i * 5) % 14, k)
        place = {0: "whole"}
        if world > 1 and i % 2 == 0:
            place[1] = "whole"
        if world > 2 and i % 3 == 0:
            place[2] = "whole"
        if k == "fp8cur":
            q = Q(name, [4], R.fp8_current(), place=place)
        elif k == "nvfp4":
            q = Q(name, [], R.nvfp4(), place=place)
        elif k == "delayed":
            q = Q(name, [], R.fp8_delayed(history_len=3), place=place)
        elif k == "rows":
            place = {r: Placement((r, 0), (1, 4)) for r in range(world)}
            q = Q(name, [world, 4], R.fp8_current(), place=place)
        elif k == "slices":
            place = {0: "whole"}
            if world > 1:
                place[1] = Placement((1, 0), (1, 16))
            q = Q(name, [2, 16], R.nvfp4(), place=place, global_axes=1)
        elif k == "running":
            q = Q(name, [2], R.fp8_current(), acc=amaxd.RUNNING_MAX, place=place)
        else:
            q = Q(name, [4], R.mxfp8(), place=place)
        cat.append(q)
    allr = {r: "whole" for r in range(world)}
    cat.append(Q("moe.e0", [4], R.fp8_current(), place=dict(allr), mask=True,
                 peer_group="moe"))
    cat.append(Q("moe.e1", [4], R.fp8_current(), place={0: "whole"}, mask=True,
                 peer_group="moe"))
    cat.append(Q("sg.a", [], R.nvfp4(), place=dict(allr), scale_group="sg"))
    cat.append(Q("sg.b", [], R.nvfp4(), place={0: "whole"}, scale_group="sg"))
    cat.append(Q("idle.q", [], R.fp8_current(), place={0: "whole"}, send_every=2))
    return cat


def added_catalog(world, tag=""):
    R = amaxd.Recipe
    allr = {r: "whole" for r in range(world)}
    return [
        Q("aaa.first" + tag, [3], R.fp8_current(), place={0: "whole"}),
        Q("layer03.aa" + tag, [], R.nvfp4(), place=dict(allr)),
        Q("zzz.last" + tag, [2], R.fp8_delayed(history_len=2), place={0: "whole", 1: "whole"} if world > 1 else {0: "whole"}),
        Q("moe.e2" + tag, [4], R.fp8_current(), place={0: "whole"}, mask=True, peer_group="moe"),
        Q("sg.c" + tag, [], R.nvfp4(), place={0: "whole"}, scale_group="sg"),
    ]


# ---------------------------------------------------------------- ranks

class Rank:
    def __init__(self, job, r, world, kind, daemon):
        self.job, self.r, self.world, self.kind, self.daemon = job, r, world, kind, daemon
        self.ex = ThreadPoolExecutor(1)
        self.c = None
        self.L = None
        self.placed = []  # Q objects this rank placed

    def submit(self, fn, *a, **kw):
        return self.ex.submit(fn, *a, **kw)

    def connect(self):
        def go():
            if self.c is not None:
                try:
                    self.c.close()
                except Exception:
                    pass
            self.c = amaxd.Client(self.job, self.r, self.world, socket=self.daemon.sock,
                                  timeout=40, shm=(self.kind == "shm"))
            return self.c.join()
        return self.submit(go)

    def register(self, qs):
        def go():
            mine = [q for q in qs if self.r in q.place]
            if mine:
                self.c.register([q.quantizer(self.r) for q in mine])
            for q in mine:
                if q.name not in [p.name for p in self.placed]:
                    self.placed.append(q)
            if self.kind != "named":
                self.L = self.c.layout(refresh=True)
            return len(mine)
        return self.submit(go)

    def values(self, rng, epoch, nan=False):
        vals = {}
        for q in self.placed:
            if epoch % q.send_every:
                continue
            shp = q.block_shape(self.r)
            v = (10.0 ** rng.uniform(-2, 2, size=shp)).astype(np.float32)
            if nan and not q.mask:
                v = np.asarray(v).copy()
                v.reshape(-1)[0] = np.nan
                nan = False
            if q.mask and v.size:
                m = rng.random(size=shp) < 0.4
                vals[q.name] = amaxd.Masked(v, m)
            else:
                vals[q.name] = v if shp else float(v)
        return vals

    # one rank's part of an epoch: send (optional), reconcile, get_scales
    def epoch(self, vals, send=True, names=(), timeout=None, getscales=True):
        def go():
            if send and vals is not None:
                self.send(vals)
            ans = self.reconcile(names=names, timeout=timeout)
            gs = self.get_scales() if getscales else None
            return ans, gs
        return self.submit(go)

    def send(self, vals):
        if self.kind == "named":
            return self.c.send(vals)
        slab, hd = self.L.pack(vals)
        return self.c.send_packed(slab, hd)

    def reconcile(self, names=(), timeout=None):
        if self.kind == "named":
            res = self.c.reconcile(names=names, timeout=timeout)
            return {n: norm_result(r) for n, r in res.items()}
        pr = self.c.reconcile_packed(timeout=timeout)
        L = self.c.layout()
        out = {}
        for i, n in enumerate(L.names):
            arr = (f32(pr.global_amax[i]), f32(pr.global_scale[i]), bool(pr.has_previous[i]),
                   f32(pr.previous_global_amax[i]), f32(pr.previous_global_scale[i]))
            out[n] = arr
            # the per-name view of the packed answer must say the same
            rv = norm_result(pr.result(n))
            if tuple(map(bits, rv[:2])) + (rv[2],) + tuple(map(bits, rv[3:])) != \
               tuple(map(bits, arr[:2])) + (arr[2],) + tuple(map(bits, arr[3:])):
                out[n + "#view-mismatch"] = rv
        return out

    def get_scales(self, whole=False):
        res = self.c.get_scales(whole=whole)
        return {n: norm_result(r) for n, r in res.items()}

    def close(self):
        def go():
            if self.c:
                try:
                    self.c.close()
                except Exception:
                    pass
        try:
            self.submit(go).result(10)
        except Exception:
            pass
        self.ex.shutdown(wait=False)


def norm_result(r):
    hp = r.previous_global_amax is not None
    return (f32(r.global_amax), f32(r.global_scale), hp,
            f32(r.previous_global_amax if hp else 0.0),
            f32(r.previous_global_scale if hp else 0.0))


def key(t):
    return (bits(t[0]), bits(t[1]), bool(t[2]), bits(t[3]), bits(t[4]))


def fmt(t):
    return "g=(%.7g,%.7g) prev=%s(%.7g,%.7g)" % (t[0], t[1], "T" if t[2] else "F", t[3], t[4])


# ---------------------------------------------------------------- the job model

class Job:
    def __init__(self, name, ranks, seed):
        self.name = name
        self.ranks = ranks
        self.hist = {}     # name -> (epoch label, ga, gs) of the last reconciled answer
        self.n = 0         # reconciled epochs seen
        self.rng = np.random.default_rng(seed)
        self.catalog = []
        self.last_answer = {}  # name -> normalized tuple of last answer
        self.answered = {}     # epoch label -> {name: tuple} (every reconciled answer)

    def connect(self):
        return [f.result(60) for f in [rk.connect() for rk in self.ranks]]

    def register(self, qs):
        self.catalog += qs
        [f.result(60) for f in [rk.register(qs) for rk in self.ranks]]

    def expected(self, name):
        h = self.hist.get(name)
        if h is None:
            return (False, 0.0, 0.0)
        return (True, h[1], h[2])

    def check_answers(self, check, label, answers, gss, extra_note="", reset_names=()):
        """answers/gss: {rank: {name: tuple}}.  Checks (1) ranks agree,
        (2) previous == last reconciled globals, (3) GetScales right after
        the answer carries the same globals and previous values."""
        bad_model, bad_agree, bad_gs, bad_view = [], [], [], []
        ambiguous = []
        merged = {}
        nans = 0
        for r, ans in answers.items():
            for n, t in ans.items():
                if n.endswith("#view-mismatch"):
                    bad_view.append("rank %d %s view %s" % (r, n, fmt(t)))
                    continue
                if n in merged and key(merged[n]) != key(t):
                    bad_agree.append("%s rank %d %s vs %s" % (n, r, fmt(t), fmt(merged[n])))
                merged.setdefault(n, t)
                if gss is not None and gss.get(r) is not None:
                    g = gss[r].get(n)
                    if g is None or key(g) != key(t):
                        bad_gs.append("rank %d %s: answer %s, GetScales right after %s"
                                      % (r, n, fmt(t), fmt(g) if g else "absent"))
        sample = None
        compared = 0
        for n, t in sorted(merged.items()):
            hp, pa, ps = self.expected(n)
            obs = (bool(t[2]), bits(t[3]), bits(t[4]))
            exp = (hp, bits(pa), bits(ps))
            compared += 1
            if n in reset_names:
                # docs do not say whether Reset clears has_previous: record both
                ambiguous.append("%s obs prev=%s(%.7g,%.7g) last-globals=%s(%.7g,%.7g)"
                                 % (n, "T" if t[2] else "F", t[3], t[4], "T" if hp else "F", pa, ps))
                continue
            if obs != exp:
                bad_model.append("%s: observed prev=%s(%.9g, %.9g) expected %s(%.9g, %.9g) [cur g=(%.9g,%.9g)]"
                                 % (n, "T" if t[2] else "F", t[3], t[4], "T" if hp else "F", pa, ps, t[0], t[1]))
            elif sample is None and hp:
                sample = "%s prev=(%.7g,%.7g)==epoch-%s globals, now g=(%.7g,%.7g)" % (
                    n, t[3], t[4], self.hist[n][0], t[0], t[1])
        nranks = len(answers)
        moved = sum(1 for n, t in merged.items() if n in self.hist and bits(self.hist[n][1]) != bits(t[0]))
        ok = not (bad_model or bad_agree or bad_view)
        report(ok, check, "%s %s: %d ranks, %d quantizers; previous == last reconciled globals%s; %d/%d globals moved%s%s"
               % (self.name, label, nranks, compared, " (e.g. %s)" % sample if sample else "",
                  moved, len([n for n in merged if n in self.hist]), extra_note,
                  "" if ok else "\n    " + "\n    ".join((bad_model + bad_agree + bad_view)[:25])))
        if gss is not None:
            report(not bad_gs, "getscales-after-answer",
                   "%s %s: GetScales issued right after each rank's answer equals the answer (%d ranks)%s"
                   % (self.name, label, len([g for g in gss.values() if g is not None]),
                      "" if not bad_gs else "\n    " + "\n    ".join(bad_gs[:25])))
        for a in ambiguous:
            report(None, "reset-ambiguous", "%s %s: %s" % (self.name, label, a))
        # update the model; quantizers no rank's answer named (a subset was
        # asked for) are taken from the GetScales right after the answer
        self.n += 1
        gs_only = {}
        if gss is not None:
            for r, g in gss.items():
                for n, t in (g or {}).items():
                    if n not in merged:
                        gs_only.setdefault(n, t)
        for n, t in list(merged.items()) + list(gs_only.items()):
            self.hist[n] = (label, t[0], t[1])
        self.answered.setdefault(label, {})
        for n, t in list(merged.items()) + list(gs_only.items()):
            self.answered[label][n] = t
        self.last_answer = dict(gs_only)
        self.last_answer.update(merged)
        return merged

    def run_epoch(self, check, label, send=True, names_for=None, reset_names=(), vals=None):
        fs = []
        for rk in self.ranks:
            v = vals[rk.r] if vals is not None else rk.values(self.rng, self.n + 1)
            nm = names_for.get(rk.r, ()) if names_for else ()
            fs.append((rk.r, rk.epoch(v, send=send, names=nm)))
        answers, gss = {}, {}
        for r, f in fs:
            a, g = f.result(60)
            answers[r], gss[r] = a, g
        return self.check_answers(check, label, answers, gss, reset_names=reset_names)

    def check_getscales_between(self, check, label, whole_rank=None):
        """Between epochs: every rank's GetScales (and one whole GetScales)
        carries the last answer's globals and previous values."""
        bad = []
        props = set()
        cnt = 0
        fs = [(rk, rk.submit(rk.get_scales)) for rk in self.ranks]
        if whole_rank is not None:
            rk = self.ranks[whole_rank]
            fs.append((rk, rk.submit(rk.get_scales, True)))
        for rk, f in fs:
            gs = f.result(60)
            for n, t in gs.items():
                cnt += 1
                a = self.last_answer.get(n)
                if a is None and n not in self.hist:
                    # a proposal not agreed yet: docs say its results read "no data"
                    props.add(n)
                    if t[2] or bits(t[0]) != 0:
                        bad.append("rank %d %s (proposal): GetScales %s, expected no data and no previous"
                                   % (rk.r, n, fmt(t)))
                    continue
                if a is None or key(a) != key(t):
                    bad.append("rank %d %s: GetScales %s, last answer %s" % (rk.r, n, fmt(t), fmt(a) if a else "absent"))
        ok = not bad
        ex = next(iter(sorted(self.last_answer.items())), None)
        report(ok, check, "%s %s: %d GetScales results (%d calls incl. whole) equal the last answer's globals/previous%s%s%s"
               % (self.name, label, cnt, len(fs), " (e.g. %s %s)" % (ex[0], fmt(ex[1])) if ex else "",
                  "; %d proposals read no data, has_previous=false" % len(props) if props else "",
                  "" if ok else "\n    " + "\n    ".join(bad[:25])))


class Observer:
    """A separate client that polls GetScales (whole, and rank 2's blocks)
    while epochs run.  Every result it sees must be, as a whole tuple
    (globals + previous), one that some reconciled epoch answered: a new
    global with a stale previous (or the reverse) is a torn read."""

    def __init__(self, daemon, job, rank, world):
        self.c = amaxd.Client(job, rank, world, socket=daemon.sock, timeout=20)
        self.seen = []
        self.errors = []
        self.stop_ = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
        self.n = 0

    def run(self):
        while not self.stop_.is_set():
            try:
                for whole in (True, False):
                    res = self.c.get_scales(whole=whole)
                    self.n += 1
                    self.seen.append({n: norm_result(r) for n, r in res.items()})
            except Exception as e:
                if "has been reconciled yet" not in str(e):  # documented before epoch 1
                    self.errors.append("%s: %s" % (type(e).__name__, str(e)[:150]))
                time.sleep(0.05)
            time.sleep(0.001)

    def start(self):
        self.t.start()
        return self

    def finish(self, job, check):
        self.stop_.set()
        self.t.join(30)
        try:
            self.c.close()
        except Exception:
            pass
        valid = {}
        for lab, d in job.answered.items():
            for n, t in d.items():
                valid.setdefault(n, set()).add(key(t))
                if not t[2]:
                    # a quantizer new to the catalog: before the epoch that agreed
                    # it, GetScales reads it as a proposal (no data, no previous)
                    valid[n].add(key((0.0, t[1], False, 0.0, 0.0)))
                    valid[n].add(key((0.0, 1.0, False, 0.0, 0.0)))
        bad = []
        cnt = 0
        for obs in self.seen:
            for n, t in obs.items():
                cnt += 1
                if n not in valid:
                    if t[2] or bits(t[0]) != 0:  # a proposal reads no data
                        bad.append("%s: %s never answered" % (n, fmt(t)))
                    continue
                if key(t) not in valid[n]:
                    bad.append("%s: %s matches no reconciled answer" % (n, fmt(t)))
        report(not bad and cnt > 0, check,
               "%s: %d concurrent GetScales calls (%d results) while epochs ran; every (globals, previous) tuple is one a reconciled epoch answered%s%s"
               % (job.name, self.n, cnt, "" if not self.errors else "; %d call errors (first: %s)" % (len(self.errors), self.errors[0]),
                  "" if not bad else "\n    " + "\n    ".join(sorted(set(bad))[:25])))


def expect_error(f, kinds, what):
    try:
        r = f.result(60)
        return False, "%s: no error (answer came)" % what
    except kinds as e:
        return True, "%s: %s" % (what, type(e).__name__)
    except Exception as e:
        return False, "%s: unexpected %s: %s" % (what, type(e).__name__, str(e)[:200])


# ---------------------------------------------------------------- checks

def single_daemon_checks():
    sd = os.path.join(BASE, "state1")
    os.makedirs(sd, exist_ok=True)
    d = Daemon("single", state_dir=sd)
    d.start()
    W = 3
    job = Job("prevjob", [Rank("prevjob", 0, W, "named", d), Rank("prevjob", 1, W, "packed", d),
                          Rank("prevjob", 2, W, "shm", d)], seed=1)
    side = Job("sidejob", [Rank("sidejob", 0, 1, "packed", d)], seed=2)
    job.connect()
    side.connect()
    cat = base_catalog(W)
    random.Random(3).shuffle(cat)
    job.register(cat)
    side.register([Q("s.one", [2], amaxd.Recipe.fp8_current(), place={0: "whole"}),
                   Q("s.two", [], amaxd.Recipe.nvfp4(), place={0: "whole"})])

    # 1. steady epochs, named + packed + shm ranks of one job, a side job interleaved
    obs = Observer(d, "prevjob", 2, W).start()
    for e in range(1, 31):
        names_for = None
        if e == 6:  # rank 0 asks for a subset of its quantizers by name
            names_for = {0: [q.name for q in cat if 0 in q.place][::3]}
        job.run_epoch("1-steady", "epoch %d" % e, names_for=names_for)
        side.run_epoch("1-steady-sidejob", "epoch %d" % e)
        if e in (4, 12, 30):
            job.check_getscales_between("4-getscales-between", "after epoch %d" % e, whole_rank=1)

    # 2. catalog change in the middle: new names that sort first, in the middle,
    # last, into the existing peer group and scale group; rank 2 adds none
    add = added_catalog(W)
    job.register(add)
    job.check_getscales_between("4-getscales-between", "after Register, before its epoch", whole_rank=1)
    for e in range(31, 41):
        job.run_epoch("2-after-register", "epoch %d" % e)
        side.run_epoch("2-after-register-sidejob", "epoch %d" % e)
    job.check_getscales_between("4-getscales-between", "after epoch 40", whole_rank=1)
    obs.finish(job, "4-getscales-concurrent")

    # Reset(drop_job) of the side job, then the same name again: a new job,
    # whose first epoch has no previous globals (docs: the job is forgotten)
    sr = side.ranks[0]
    sr.submit(lambda: sr.c.reset(drop_job=True)).result(30)
    side2 = Job("sidejob", [Rank("sidejob", 0, 1, "packed", d)], seed=4)
    side2.connect()
    side2.register([Q("s.one", [2], amaxd.Recipe.fp8_current(), place={0: "whole"}),
                    Q("s.two", [], amaxd.Recipe.nvfp4(), place={0: "whole"})])
    sr.close()
    side = side2
    for e in range(1, 4):
        side.run_epoch("drop-job-recreated", "new sidejob epoch %d" % e)

    lids = [rk.L.id for rk in job.ranks[1:]]
    job.register([Q("aaaa.rank0only", [2], amaxd.Recipe.fp8_current(), place={0: "whole"}),
                  Q("layer07.rank0only", [], amaxd.Recipe.nvfp4(), place={0: "whole"})])
    report(lids == [rk.L.id for rk in job.ranks[1:]], "2-after-register",
           "Register by rank 0 only: packed ranks' layout ids unchanged (%s -> %s), catalog indices shifted"
           % (lids, [rk.L.id for rk in job.ranks[1:]]))
    for e in range(41, 44):
        job.run_epoch("2-after-register-rank0only", "epoch %d" % e)

    # 3a. bad input: NaN refused at send (named and packed), then the epoch goes on
    r0, r1 = job.ranks[0], job.ranks[1]
    ok0, m0 = expect_error(r0.submit(r0.send, r0.values(job.rng, 1, nan=True)), (E.InvalidArgument, ValueError), "rank 0 SendAmax with a NaN")
    ok1, m1 = expect_error(r1.submit(r1.send, r1.values(job.rng, 1, nan=True)), (E.InvalidArgument, ValueError), "rank 1 SendPacked with a NaN")
    report(ok0 and ok1, "3-failed-input", "%s; %s" % (m0, m1))
    job.check_getscales_between("4-getscales-between", "after refused NaN sends")
    job.run_epoch("3-after-nan", "epoch 44 (after NaN refusals)")

    # 3b. a rank that does not come: ranks 0, 1 get DEADLINE_EXCEEDED (failed epoch)
    vals = {rk.r: rk.values(job.rng, 45) for rk in job.ranks}
    fa = [job.ranks[i].epoch(vals[i], getscales=False) for i in (0, 1)]
    res = [expect_error(f, (E.DeadlineExceeded,), "rank %d Reconcile without rank 2" % i) for i, f in zip((0, 1), fa)]
    report(all(r[0] for r in res), "3-failed-epoch", "; ".join(r[1] for r in res))
    st = job.ranks[0].submit(lambda: job.ranks[0].c.status("prevjob")).result(30)
    jst = [j for j in st.jobs if j.name == "prevjob"][0]
    report(None, "3-failed-epoch", "status after the deadline: epoch=%d reconciled_epochs=%d %s"
           % (jst.epoch, jst.reconciled_epochs, " ".join("%s=%s" % (f.name, v) for f, v in jst.ListFields() if "fail" in f.name)))
    job.check_getscales_between("4-getscales-between", "after the failed (timed-out) epoch", whole_rank=2)
    # rank 2 sends now; everyone reconciles the same epoch again
    fs = [job.ranks[0].epoch(None, send=False), job.ranks[1].epoch(None, send=False),
          job.ranks[2].epoch(vals[2])]
    answers, gss = {}, {}
    for rk, f in zip(job.ranks, fs):
        answers[rk.r], gss[rk.r] = f.result(60)
    job.check_answers("3-after-failed-epoch", "epoch 45 (retry after the deadline)", answers, gss)
    for e in range(46, 49):
        job.run_epoch("3-after-failed-epoch", "epoch %d" % e)

    # 3c. a client that gives up (client deadline) while the others are absent
    f = job.ranks[1].epoch(job.ranks[1].values(job.rng, 24), timeout=0.5, getscales=False)
    ok, m = expect_error(f, (E.DeadlineExceeded, E.AmaxdError), "rank 1 Reconcile with a 0.5 s client deadline")
    report(ok, "3-failed-epoch", m)
    time.sleep(0.3)
    job.check_getscales_between("4-getscales-between", "after a client gave up")
    fs = [job.ranks[0].epoch(job.ranks[0].values(job.rng, 24)), job.ranks[1].epoch(None, send=False),
          job.ranks[2].epoch(job.ranks[2].values(job.rng, 24))]
    answers, gss = {}, {}
    for rk, f in zip(job.ranks, fs):
        answers[rk.r], gss[rk.r] = f.result(60)
    job.check_answers("3-after-failed-epoch", "epoch 49 (after a client gave up)", answers, gss)
    job.run_epoch("3-after-failed-epoch", "epoch 50")

    # Reset of a few quantizers (docs ambiguous on has_previous after a Reset)
    rnames = [q.name for q in cat if "delayed" in q.name][:1] + ["sg.a", "layer03.aa"]
    job.ranks[0].submit(lambda: job.ranks[0].c.reset(rnames)).result(30)
    job.check_getscales_between("4-getscales-between", "after Reset requested (not yet applied)")
    job.run_epoch("reset", "epoch 51 (applies Reset of %s)" % ",".join(rnames), reset_names=rnames)
    job.run_epoch("reset", "epoch 52 (after Reset)")
    job.run_epoch("reset", "epoch 53")
    job.check_getscales_between("4-getscales-between", "after epoch 53", whole_rank=0)

    # 5a. kill -9 during an epoch: rank 0 waits in Reconcile, rank 1 has sent, rank 2 not
    f0 = job.ranks[0].epoch(job.ranks[0].values(job.rng, 54), getscales=False)
    job.ranks[1].submit(job.ranks[1].send, job.ranks[1].values(job.rng, 54)).result(30)
    time.sleep(0.3)
    d.kill9()
    ok, m = expect_error(f0, (E.Unavailable, E.AmaxdError, Exception), "rank 0 Reconcile while the daemon is killed")
    report(ok, "5-restart-mid-epoch", m)
    for rk in job.ranks + side.ranks:
        rk.c = None
    d.start()
    js = job.connect()
    side.connect()
    for rk in job.ranks + side.ranks:
        if rk.kind != "named":
            rk.L = rk.submit(rk.c.layout, True).result(30)
    report(all(j.rejoined for j in js), "5-restart-mid-epoch", "restart after a kill during epoch 54: rejoined=%s open epoch=%s"
           % ([j.rejoined for j in js], [j.epoch for j in js]))
    job.check_getscales_between("5-restart-mid-epoch", "GetScales after restore (killed mid-epoch)", whole_rank=2)
    job.run_epoch("5-after-restart-mid-epoch", "epoch 54 (after the kill during it)")
    job.run_epoch("5-after-restart-mid-epoch", "epoch 55")

    # 5. kill -9 between epochs, restart from state_dir, re-join, go on
    before = {rk.r: rk.submit(rk.get_scales).result(30) for rk in job.ranks}
    d.kill9()
    for rk in job.ranks + side.ranks:
        rk.c = None
    d.start()
    js = job.connect()
    side.connect()
    report(all(j.rejoined for j in js), "5-restart", "after kill -9 and restart from state_dir: Join rejoined=%s epoch=%s"
           % ([j.rejoined for j in js], [j.epoch for j in js]))
    for rk in job.ranks:
        if rk.kind != "named":
            rk.L = rk.submit(rk.c.layout, True).result(30)
    for rk in side.ranks:
        rk.L = rk.submit(rk.c.layout, True).result(30)
    bad = []
    cnt = 0
    for rk in job.ranks:
        after = rk.submit(rk.get_scales).result(30)
        for n, t in before[rk.r].items():
            cnt += 1
            a = after.get(n)
            if a is None or key(a) != key(t):
                bad.append("rank %d %s: before kill %s, after restore %s" % (rk.r, n, fmt(t), fmt(a) if a else "absent"))
    report(not bad, "5-restart", "GetScales after restore == before kill -9 (%d results)%s"
           % (cnt, "" if not bad else "\n    " + "\n    ".join(bad[:25])))
    job.check_getscales_between("5-restart", "GetScales after restore vs last answer", whole_rank=1)
    for e in range(56, 60):
        job.run_epoch("5-after-restart", "epoch %d" % e)
        side.run_epoch("5-after-restart-sidejob", "epoch %d" % e)
    # restart again, then a catalog change as the first thing after the restore
    d.kill9()
    for rk in job.ranks + side.ranks:
        rk.c = None
    d.start()
    job.connect()
    side.connect()
    for rk in job.ranks + side.ranks:
        if rk.kind != "named":
            rk.L = rk.submit(rk.c.layout, True).result(30)
    job.check_getscales_between("5-restart", "GetScales after 2nd restore", whole_rank=2)
    job.register([Q("aab.after-restore", [], amaxd.Recipe.nvfp4(), place={0: "whole", 1: "whole", 2: "whole"})])
    obs = Observer(d, "prevjob", 1, W).start()
    for e in range(60, 65):
        job.run_epoch("5-after-restart+register", "epoch %d" % e)
    job.check_getscales_between("4-getscales-between", "after epoch 64", whole_rank=1)
    obs.finish(job, "4-getscales-concurrent")

    for rk in job.ranks + side.ranks:
        rk.close()
    d.stop()


def interval_restore_checks():
    sd = os.path.join(BASE, "state_interval")
    os.makedirs(sd, exist_ok=True)
    d = Daemon("interval", ["--snapshot_interval_ms=1500"], state_dir=sd)
    d.start()
    W = 2
    job = Job("durjob", [Rank("durjob", 0, W, "named", d), Rank("durjob", 1, W, "shm", d)], seed=21)
    try:
        job.connect()
        cat = base_catalog(W)
        job.register(cat)
        for e in range(1, 8):
            if e == 4:
                time.sleep(1.7)  # epoch 4 is written (1.5 s after epoch 1's snapshot), 5..7 are not
            job.run_epoch("5b-interval", "epoch %d" % e)
        st = job.ranks[0].submit(lambda: job.ranks[0].c.status("durjob")).result(30)
        jst = [j for j in st.jobs if j.name == "durjob"][0]
        K = int(jst.durable_epoch)
        report(None, "5b-interval", "snapshot_interval_ms=1500: after 7 epochs durable_epoch=%d" % K)
        d.kill9()
        for rk in job.ranks:
            rk.c = None
        d.start()
        js = job.connect()
        for rk in job.ranks:
            if rk.kind != "named":
                rk.L = rk.submit(rk.c.layout, True).result(30)
        report(all(j.rejoined for j in js) and all(j.epoch == K + 1 for j in js), "5b-interval",
               "restored behind: rejoined=%s open epoch=%s (expected %d)" % ([j.rejoined for j in js], [j.epoch for j in js], K + 1))
        if K >= 1:
            # the model goes back to epoch K: GetScales answers epoch K's results
            ansK = job.answered["epoch %d" % K]
            job.hist = {n: ("epoch %d" % K, t[0], t[1]) for n, t in ansK.items()}
            job.last_answer = dict(ansK)
            job.check_getscales_between("5b-interval", "GetScales after a restore to epoch %d (of 7)" % K, whole_rank=1)
            for e in range(K + 1, K + 4):
                job.run_epoch("5b-interval-after-restore", "epoch %d (again, after restore to %d)" % (e, K))
    finally:
        for rk in job.ranks:
            rk.close()
        d.stop()


def cluster_checks():
    secret = os.path.join(BASE, "secret")
    with open(secret, "wb") as fh:
        fh.write(os.urandom(24).hex().encode())
    os.chmod(secret, 0o600)
    pa, pb = free_port(), free_port()
    common = ["--cluster_size=2", "--coordinator=127.0.0.1:%d" % pa,
              "--cluster_secret_file=" + secret, "--gloo_host=127.0.0.1", "--collective=gloo"]
    sa, sb = os.path.join(BASE, "stateA"), os.path.join(BASE, "stateB")
    os.makedirs(sa, exist_ok=True)
    os.makedirs(sb, exist_ok=True)
    A = Daemon("clA", common + ["--cluster_rank=0", "--peer_listen=127.0.0.1:%d" % pa,
                                "--peer_advertise=127.0.0.1:%d" % pa], state_dir=sa)
    B = Daemon("clB", common + ["--cluster_rank=1", "--peer_listen=127.0.0.1:%d" % pb,
                                "--peer_advertise=127.0.0.1:%d" % pb], state_dir=sb)
    A.start()
    B.start()
    W = 2
    job = Job("cljob", [Rank("cljob", 0, W, "named", A), Rank("cljob", 1, W, "shm", B)], seed=11)
    try:
        job.connect()
        cat = base_catalog(W)
        random.Random(5).shuffle(cat)
        job.register(cat)
        obs = Observer(B, "cljob", 1, W).start()
        for e in range(1, 11):
            job.run_epoch("6-cluster-steady", "epoch %d" % e)
        obs.finish(job, "6-cluster-getscales-concurrent")
        job.check_getscales_between("6-cluster-getscales", "after epoch 10", whole_rank=1)
        job.register(added_catalog(W))
        for e in range(11, 13):
            job.run_epoch("6-cluster-after-register", "epoch %d" % e)
        job.register([Q("aaaa.bonly", [3], amaxd.Recipe.fp8_current(), place={1: "whole"}),
                      Q("layer05.bonly", [], amaxd.Recipe.nvfp4(), place={1: "whole"})])
        for e in range(13, 15):
            job.run_epoch("6-cluster-after-register-B-only", "epoch %d" % e)
        # failed epoch: rank 1 (daemon B) does not come; daemon A's engine starts and fails
        v0 = job.ranks[0].values(job.rng, 15)
        ok, m = expect_error(job.ranks[0].epoch(v0, getscales=False), (E.DeadlineExceeded, E.Unavailable, E.Aborted),
                             "rank 0 (daemon A) Reconcile while rank 1 (daemon B) stays away")
        report(ok, "6-cluster-failed-epoch", m)
        job.check_getscales_between("6-cluster-getscales", "after the failed epoch", whole_rank=0)
        # retry: rank 0 may need several attempts (ABORTED after a failure is documented)
        v1 = job.ranks[1].values(job.rng, 15)
        answers = gss = None
        for attempt in range(4):
            fs = [job.ranks[0].epoch(None, send=False), job.ranks[1].epoch(v1 if attempt == 0 else None, send=(attempt == 0))]
            try:
                rs = [f.result(60) for f in fs]
                answers = {0: rs[0][0], 1: rs[1][0]}
                gss = {0: rs[0][1], 1: rs[1][1]}
                break
            except Exception as e:
                report(None, "6-cluster-failed-epoch", "retry attempt %d: %s %s" % (attempt, type(e).__name__, str(e)[:160]))
                for f in fs:
                    try:
                        f.result(60)
                    except Exception:
                        pass
        if answers is None:
            report(False, "6-cluster-after-failed-epoch", "retry never succeeded")
        else:
            job.check_answers("6-cluster-after-failed-epoch", "epoch 15 (retry)", answers, gss)
        for e in range(16, 18):
            job.run_epoch("6-cluster-after-failed-epoch", "epoch %d" % e)
        # two failed attempts in a row, this time daemon B's rank waits and A's stays away
        vb = job.ranks[1].values(job.rng, 18)
        for k in range(2):
            ok, m = expect_error(job.ranks[1].epoch(vb if k == 0 else None, send=(k == 0), getscales=False),
                                 (E.DeadlineExceeded, E.Unavailable, E.Aborted),
                                 "attempt %d: rank 1 (daemon B) Reconcile while rank 0 (daemon A) stays away" % (k + 1))
            report(ok, "6-cluster-failed-epoch", m)
        job.check_getscales_between("6-cluster-getscales", "after two failed attempts", whole_rank=1)
        answers = None
        va = job.ranks[0].values(job.rng, 18)
        for attempt in range(4):
            fs = [job.ranks[0].epoch(va if attempt == 0 else None, send=(attempt == 0)), job.ranks[1].epoch(None, send=False)]
            try:
                rs = [f.result(60) for f in fs]
                answers = {0: rs[0][0], 1: rs[1][0]}
                gss = {0: rs[0][1], 1: rs[1][1]}
                break
            except Exception as e:
                report(None, "6-cluster-failed-epoch", "retry attempt %d: %s %s" % (attempt, type(e).__name__, str(e)[:160]))
                for f in fs:
                    try:
                        f.result(60)
                    except Exception:
                        pass
        if answers is None:
            report(False, "6-cluster-after-failed-epoch", "retry never succeeded")
        else:
            job.check_answers("6-cluster-after-failed-epoch", "epoch 18 (retry after 2 failures)", answers, gss)
        # catalog conflict between the daemons: both Reconciles fail, then go on
        ra, rb = job.ranks
        ra.submit(lambda: ra.c.register([amaxd.Quantizer("conf.q", [], amaxd.Recipe.fp8_current())])).result(30)
        rb.submit(lambda: rb.c.register([amaxd.Quantizer("conf.q", [], amaxd.Recipe.nvfp4())])).result(30)
        rb.L = rb.submit(rb.c.layout, True).result(30)
        fs = [ra.epoch(ra.values(job.rng, 19), getscales=False), rb.epoch(rb.values(job.rng, 19), getscales=False)]
        res = [expect_error(f, (E.FailedPrecondition,), "rank %d Reconcile with a catalog conflict" % i) for i, f in enumerate(fs)]
        report(all(r[0] for r in res), "6-cluster-conflict", "; ".join(r[1] for r in res))
        rb.L = rb.submit(rb.c.layout, True).result(30)
        job.check_getscales_between("6-cluster-getscales", "after the conflict")
        answers = None
        for attempt in range(3):
            fs = [ra.epoch(None, send=False), rb.epoch(None, send=False)]
            try:
                rs = [f.result(60) for f in fs]
                answers = {0: {k: v for k, v in rs[0][0].items() if k != "conf.q"}, 1: {k: v for k, v in rs[1][0].items() if k != "conf.q"}}
                gss = {0: rs[0][1], 1: rs[1][1]}
                break
            except Exception as e:
                report(None, "6-cluster-conflict", "retry attempt %d: %s %s" % (attempt, type(e).__name__, str(e)[:160]))
                for f in fs:
                    try:
                        f.result(60)
                    except Exception:
                        pass
                rb.L = rb.submit(rb.c.layout, True).result(30)
        if answers is None:
            report(False, "6-cluster-after-conflict", "retry never succeeded")
        else:
            job.check_answers("6-cluster-after-conflict", "epoch 19 (retry after conflict)", answers, gss)
        for e in range(20, 22):
            job.run_epoch("6-cluster-after-conflict", "epoch %d" % e)
        # kill -9 daemon B between epochs, restart it from its state_dir
        B.kill9()
        job.ranks[1].c = None
        B.start()
        js = job.ranks[1].connect().result(60)
        rb.L = rb.submit(rb.c.layout, True).result(30)
        report(bool(js.rejoined), "6-cluster-restart", "daemon B killed -9 and restarted from state_dir: rejoined=%s epoch=%d" % (js.rejoined, js.epoch))
        job.check_getscales_between("6-cluster-getscales", "after B's restore", whole_rank=1)
        answers = None
        for attempt in range(4):
            fs = [ra.epoch(ra.values(job.rng, 22) if attempt == 0 else None, send=(attempt == 0)),
                  rb.epoch(rb.values(job.rng, 22) if attempt == 0 else None, send=(attempt == 0))]
            try:
                rs = [f.result(60) for f in fs]
                answers = {0: rs[0][0], 1: rs[1][0]}
                gss = {0: rs[0][1], 1: rs[1][1]}
                break
            except Exception as e:
                report(None, "6-cluster-restart", "attempt %d: %s %s" % (attempt, type(e).__name__, str(e)[:160]))
                for f in fs:
                    try:
                        f.result(60)
                    except Exception:
                        pass
        if answers is None:
            report(False, "6-cluster-after-restart", "epoch never succeeded")
        else:
            job.check_answers("6-cluster-after-restart", "epoch 22 (first after B's restart)", answers, gss)
        for e in range(23, 25):
            job.run_epoch("6-cluster-after-restart", "epoch %d" % e)
        # kill -9 daemon B and restart it WITHOUT its state: it catches up from A (job state format 5)
        B.kill9()
        shutil.rmtree(sb)
        os.makedirs(sb)
        job.ranks[1].c = None
        B.start()
        js = job.ranks[1].connect().result(60)
        rb.placed = []
        rb.register(job.catalog).result(60)
        report(None, "6-cluster-catchup", "daemon B restarted without state: rejoined=%s epoch=%d" % (js.rejoined, js.epoch))
        answers = None
        v = {0: ra.values(job.rng, 25), 1: rb.values(job.rng, 25)}
        for attempt in range(5):
            fs = [ra.epoch(v[0], send=(attempt == 0)), rb.epoch(v[1])]
            try:
                rs = [f.result(60) for f in fs]
                answers = {0: rs[0][0], 1: rs[1][0]}
                gss = {0: rs[0][1], 1: rs[1][1]}
                break
            except Exception as e:
                report(None, "6-cluster-catchup", "attempt %d: %s %s" % (attempt, type(e).__name__, str(e)[:200]))
                for f in fs:
                    try:
                        f.result(60)
                    except Exception:
                        pass
                rb.L = rb.submit(rb.c.layout, True).result(30)
        if answers is None:
            report(False, "6-cluster-after-catchup", "epoch never succeeded")
        else:
            job.check_answers("6-cluster-after-catchup", "epoch 25 (first after B caught up)", answers, gss)
        for e in range(26, 28):
            job.run_epoch("6-cluster-after-catchup", "epoch %d" % e)
        job.check_getscales_between("6-cluster-getscales", "after epoch 27", whole_rank=1)
    finally:
        for rk in job.ranks:
            rk.close()
        A.stop()
        B.stop()


def main():
    shutil.rmtree(BASE, ignore_errors=True)
    os.makedirs(BASE)
    os.makedirs(SHM, exist_ok=True)
    t0 = time.time()
    try:
        for part in (single_daemon_checks, interval_restore_checks, cluster_checks):
            try:
                part()
            except Exception as e:
                report(False, part.__name__, "aborted: %s: %s\n%s" % (type(e).__name__, e, traceback.format_exc()))
    finally:
        for p in PROCS:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(SHM, ignore_errors=True)
    npass = sum(1 for r in RESULTS if r[0] is True)
    nfail = sum(1 for r in RESULTS if r[0] is False)
    ninfo = sum(1 for r in RESULTS if r[0] is None)
    log("\nSUMMARY: %d PASS, %d FAIL, %d INFO (%.0f s)" % (npass, nfail, ninfo, time.time() - t0))
    byc = {}
    for ok, c, _ in RESULTS:
        b = byc.setdefault(c, [0, 0, 0])
        b[0 if ok is True else 1 if ok is False else 2] += 1
    for c, (p, f, i) in byc.items():
        log("  %-32s pass %3d  fail %3d  info %3d" % (c, p, f, i))
    for ok, c, m in RESULTS:
        if ok is False:
            log("FAILED: [%s] %s" % (c, m.splitlines()[0]))
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())
