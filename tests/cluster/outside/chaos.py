#!/usr/bin/env python3
"""Black-box fault-injection checker for amaxd clusters (outside tester).

Model
-----
* A job of W ranks, spread over 2-3 daemons (Gloo on loopback).
* The amax a rank sends for epoch k is a pure function inputs(k, rank)
  (seeded RNG), so the bytes an uninterrupted run gives for epoch k are
  well defined.  The trainer follows the epoch the daemon numbers (Join's
  open epoch, Reconcile's next_epoch, Status's open epoch after a
  refusal) and always sends inputs(<that epoch>, rank).
* Every answer a trainer gets (a Reconcile answer for epoch k, or a
  GetScales read of epoch k after it missed the Reconcile answer) must be
  byte-identical to what the uninterrupted control run (same topology, no
  faults) gave that rank for epoch k; errors are fine if they are of the
  documented kinds.  Reconcile(epoch=e) must answer epoch == e.
* Every call must return within its documented deadline (+ slack); every
  rank must reach the last epoch; no daemon may crash.

* rejoin-inflight/...: a trainer killed -9 inside Reconcile while its
  daemon's epoch is in flight, re-joined by a new trainer (docs/API.md,
  the Join row "a rank calls Join again after the job is ready"); the
  Join itself must say rejoined=true and the epoch after the flight
  (check_inflight), every answer is checked as above.

Run:  .venv/bin/python tests/cluster/outside/chaos.py [scenario-regex ...]  (from the repository)
      (--list to list scenarios, --trials N to add random scenarios,
      --repeat N to run the selection N times)
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

BUILD = os.environ.get("AMAXD_BUILD", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "..", "..", "..", "build"))
AMAXD = os.environ.get("AMAXD_BIN", os.path.join(BUILD, "amaxd"))
PY = sys.executable
HERE = os.path.dirname(os.path.abspath(__file__))

RECONCILE_TIMEOUT_MS = 3000
JOIN_TIMEOUT_MS = 6000
CLIENT_TIMEOUT = 25.0          # client-side deadline: a call that needs it is a hang
HANG_SLACK = 4.0               # seconds over the documented deadline
EPOCHS = 7


# ---------------------------------------------------------------- the job

def quantizers(rank, W):
    import amaxd
    from amaxd import placement as P
    tp = 2
    tpr = rank % tp
    ep = max(1, W // tp)
    epr = rank // tp
    PE = amaxd.PER_EPOCH
    return [
        amaxd.Quantizer("a.fc1.w", [8], amaxd.Recipe.fp8_current(), P.column_parallel([8], tpr, tp),
                        accumulation=PE),
        amaxd.Quantizer("a.fc2.w", [8], amaxd.Recipe.fp8_current(output="modelopt"),
                        P.replicated([8])),  # RUNNING_MAX
        amaxd.Quantizer("b.in", [], amaxd.Recipe.fp8_delayed(history_len=4, margin=1.0),
                        accumulation=PE),
        amaxd.Quantizer("b.in2", [4], amaxd.Recipe.fp8_delayed(history_len=3, reduce="most_recent",
                                                              history="te_unfused"),
                        P.shard([4], 0, tpr, tp), accumulation=PE),
        amaxd.Quantizer("c.nv", [4, 8], amaxd.Recipe.nvfp4(), P.row_parallel([4, 8], tpr, tp)),
        amaxd.Quantizer("c.nve", [2, 2, 4], amaxd.Recipe.nvfp4(), P.shard([2, 2, 4], 0, tpr, tp),
                        accumulation=PE, global_axes=1),
        amaxd.Quantizer("d.mx", [16], amaxd.Recipe.mxfp8(), P.shard([16], 0, tpr, tp),
                        accumulation=PE),
        amaxd.Quantizer("e.exp", [12], amaxd.Recipe.fp8_current(), P.per_expert(12, epr, ep),
                        accumulation=PE, peer_group="g.fill"),
        amaxd.Quantizer("e.exp2", [12], amaxd.Recipe.fp8_current(), P.per_expert(12, epr, ep),
                        accumulation=PE, peer_group="g.share", peer_mode="share"),
    ]


def inputs(epoch, rank, W):
    """{name: block} that `rank` sends for `epoch` (pure function)."""
    import amaxd
    out = {}
    for qi, q in enumerate(quantizers(rank, W)):
        shape = tuple(q.placement.local_shape) if q.placement else tuple(q.global_shape)
        rng = np.random.default_rng([epoch, rank, qi, 12345])
        n = int(np.prod(shape)) if shape else 1
        v = np.exp(rng.uniform(-6, 6, size=n)).astype(np.float32)
        if q.name == "b.in" and epoch % 5 == 0:
            v[:] = 0.0   # a zero epoch for the delayed history
        v = v.reshape(shape) if shape else v.reshape(())
        if q.name.startswith("e.exp"):
            mask = rng.uniform(size=n) < 0.35
            out[q.name] = amaxd.Masked(v, mask.reshape(shape))
        else:
            out[q.name] = v if shape else float(v)
    return out


# ---------------------------------------------------------------- results

def f32hex(x):
    return struct.pack("<f", x).hex()


def res_dict(q):
    d = {"offset": list(q.offset), "shape": list(q.shape),
         "amax": q.amax.hex(), "scale": q.scale.hex(), "scale_inv": q.scale_inv.hex(),
         "block_scales": q.block_scales.hex(),
         "global_amax": f32hex(q.global_amax), "global_scale": f32hex(q.global_scale),
         "global_scale_inv": f32hex(q.global_scale_inv),
         "global_amaxes": q.global_amaxes.hex(), "global_scales": q.global_scales.hex(),
         "global_scale_invs": q.global_scale_invs.hex(),
         "missing": q.missing, "has_previous": q.has_previous,
         "previous_global_amax": f32hex(q.previous_global_amax) if q.has_previous else "",
         "previous_global_scale": f32hex(q.previous_global_scale) if q.has_previous else "",
         "peer_fill_known": q.peer_fill_known,
         "filled": (q.filled.hex() if q.peer_filled else "") if q.peer_fill_known else None}
    return d


# ---------------------------------------------------------------- trainer

def trainer_main(cfg_path, rank):
    import amaxd
    from amaxd import errors as E
    from amaxd import pb
    cfg = json.load(open(cfg_path))
    W, job, E_last = cfg["W"], cfg["job"], cfg["epochs"]
    sock = cfg["sockets"][str(rank)]
    ctl = cfg["ctl"]
    policy = cfg.get("policy", "follow")
    out_path = os.path.join(cfg["out"], f"trainer.{rank}.jsonl")
    restarted = os.path.exists(out_path) and os.path.getsize(out_path) > 0  # an earlier trainer of this rank
    out = open(out_path, "a", buffering=1)
    pace = cfg.get("pace", 0.02)

    def log(**kw):
        kw["t"] = time.time()
        kw["rank"] = rank
        kw["pid"] = os.getpid()
        out.write(json.dumps(kw) + "\n")

    def hold(phase, e):
        hf = os.path.join(ctl, f"hold.{rank}")
        tag = f"{phase} {e}"
        while True:
            try:
                want = open(hf).read().strip()
            except FileNotFoundError:
                return
            if want != tag and want != f"{phase} *":   # "<phase> *": any epoch
                return
            af = os.path.join(ctl, f"at.{rank}")
            with open(af + ".tmp", "w") as f:
                f.write(tag)
            os.replace(af + ".tmp", af)
            time.sleep(0.01)

    def mk():
        return amaxd.Client(job, rank, W, socket=sock, timeout=CLIENT_TIMEOUT)

    c = mk()
    qs = quantizers(rank, W)
    log(ev="start")
    need_join = True
    e = None          # the epoch this trainer is on (as numbered by the daemon)
    my_step = None    # the trainer's own step counter (policy "own")
    deadline = time.time() + cfg.get("trainer_budget", 70)

    def timed(name, fn, limit):
        t0 = time.time()
        try:
            return fn()
        finally:
            dur = time.time() - t0
            if dur > limit:
                log(ev="slow", call=name, dur=dur, limit=limit)

    rt_s = cfg.get("reconcile_timeout_ms", RECONCILE_TIMEOUT_MS) / 1000
    rlimit = rt_s + HANG_SLACK + cfg.get("extra_slack", 0)
    jlimit = JOIN_TIMEOUT_MS / 1000 + HANG_SLACK + cfg.get("extra_slack", 0)

    def getscales(why):
        r = timed("GetScales", lambda: c._unary("GetScales", pb.GetScalesRequest(job=job, rank=rank),
                                               pb.GetScalesResponse), rlimit)
        log(ev="answer", src="getscales", why=why, epoch=r.epoch, req_epoch=None,
            res={q.name: res_dict(q) for q in r.results})
        return r.epoch

    def getscales_checked(why):
        # an extra read (checked like every answer); errors of the documented kinds are logged only
        try:
            getscales(why)
        except E.AmaxdError as err:
            log(ev="error", call="GetScales", code=err.code.name, msg=err.message, epoch=e)

    rejoin_reads = cfg.get("getscales_on_rejoin", False) and restarted

    def open_epoch():
        jobs = c.status(job).jobs
        return jobs[0].epoch if jobs else None

    while True:
        if time.time() > deadline:
            log(ev="gave_up", epoch=e)
            return 3
        if e is not None and e > E_last:
            break
        call = "?"
        try:
            if need_join:
                hold("join", e)
                call = "Join"
                t0 = time.time()
                r = timed("Join", lambda: c.join(), jlimit)
                log(ev="join", epoch=r.epoch, rejoined=r.rejoined, dur=time.time() - t0)
                if rejoin_reads and r.rejoined:
                    getscales_checked("rejoin")
                if not r.rejoined:
                    call = "Register"
                    rr = c.register(qs)
                    log(ev="register", created=rr.created, existing=rr.existing)
                if e is not None and r.epoch > e:
                    # it missed the answer of epoch(s) e .. r.epoch-1: read the last one
                    call = "GetScales"
                    getscales("join_ahead")
                    my_step = max(my_step or 0, r.epoch)
                if e is not None and r.epoch < e:
                    log(ev="join_behind", had=e, open=r.epoch)
                if my_step is None:
                    my_step = r.epoch
                e = r.epoch
                need_join = False
                if e > E_last:
                    break
            hold("send", e)
            call = "SendAmax"
            sent_for = e if policy == "follow" else my_step
            subst = cfg.get("subst", {}).get(f"{rank}:{sent_for}")
            if subst:
                for j in subst[1:]:
                    c.send(inputs(j, rank, W), epoch=e)
                vals = inputs(subst[0], rank, W)
            else:
                vals = inputs(sent_for, rank, W)
            if sent_for != e:
                log(ev="send_own_step", epoch=e, step=sent_for)
            timed("SendAmax", lambda: c.send(vals, epoch=e), rlimit)
            log(ev="sent", epoch=e, step=sent_for)
            hold("reconcile", e)
            if rejoin_reads:
                # docs: the epoch in flight at the re-join is read with GetScales once it has ended
                getscales_checked("rejoin_before_reconcile")
                rejoin_reads = False
            call = "Reconcile"
            t0 = time.time()
            req = pb.ReconcileRequest(job=job, rank=rank, epoch=e)
            resp = timed("Reconcile", lambda: c._unary("Reconcile", req, pb.ReconcileResponse), rlimit)
            log(ev="answer", src="reconcile", epoch=resp.epoch, req_epoch=e,
                next_epoch=resp.next_epoch, dur=time.time() - t0,
                res={q.name: res_dict(q) for q in resp.results})
            e = resp.next_epoch
            my_step = resp.epoch + 1
            hold("after", e - 1)
            time.sleep(pace * random.random())
        except E.AmaxdError as err:
            code = err.code.name
            log(ev="error", call=call, code=code, msg=err.message, epoch=e)
            msg = err.message
            if isinstance(err, E.NotFound):
                time.sleep(0.05)
                if "not registered" in msg:
                    # docs: Register calls since the last reconciled epoch are not
                    # durable -- register again (idempotent)
                    try:
                        rr = c.register(qs)
                        log(ev="register", created=rr.created, existing=rr.existing, why="not_found")
                    except E.AmaxdError as err2:
                        log(ev="error", call="Register", code=err2.code.name, msg=err2.message, epoch=e)
                else:
                    need_join = True
            elif isinstance(err, E.FailedPrecondition):
                if "register" in msg.lower() and call != "Join":
                    time.sleep(0.05)
                    try:
                        rr = c.register(qs)
                        log(ev="register", created=rr.created, existing=rr.existing, why="fp")
                    except E.AmaxdError as err2:
                        log(ev="error", call="Register", code=err2.code.name, msg=err2.message, epoch=e)
                elif call == "Join" or "join" in msg.lower() or "not ready" in msg.lower():
                    need_join = True
                    time.sleep(0.1)
                else:
                    # an epoch that was already reconciled / not open: learn the open one
                    try:
                        o = open_epoch()
                    except E.AmaxdError:
                        o = None
                    log(ev="learn", open=o, had=e)
                    if o is None:
                        need_join = True
                    elif o > e:
                        getscales("fp_ahead")
                        e = o
                        my_step = max(my_step or 0, o)
                    elif o < e:
                        log(ev="daemon_behind", had=e, open=o)
                        e = o
                    else:
                        time.sleep(0.1)
            elif isinstance(err, (E.Unavailable,)):
                # its daemon may have restarted: Join again (returns at once with
                # rejoined=true when the daemon still has the job)
                need_join = True
                time.sleep(0.15)
                try:
                    c.close()
                except Exception:
                    pass
                c = mk()
            elif isinstance(err, (E.DeadlineExceeded, E.Aborted)):
                time.sleep(0.05)
            else:
                time.sleep(0.2)
        except Exception as ex:  # noqa
            log(ev="exception", call=call, msg=repr(ex), tb=traceback.format_exc())
            time.sleep(0.2)
    log(ev="done", epoch=e)
    c.close()
    return 0


# ---------------------------------------------------------------- cluster

def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Cluster:
    def __init__(self, root, n, state=(True,), extra=(), candidates=1, asan=False, extra_per=None,
                 reconcile_timeout_ms=RECONCILE_TIMEOUT_MS):
        self.root, self.n = root, n
        self.reconcile_timeout_ms = reconcile_timeout_ms
        self.state = [state[i] if i < len(state) else state[-1] for i in range(n)]
        self.ports = [free_port() for _ in range(n)]
        self.secret = os.path.join(root, "secret")
        with open(self.secret, "w") as f:
            f.write("s3cr3t-0123456789-abcdefghijklmnop\n")
        os.chmod(self.secret, 0o600)
        self.procs = [None] * n
        self.killed = set()
        self.extra = list(extra)
        self.extra_per = extra_per or {}
        self.candidates = candidates
        self.exe = AMAXD if not asan else os.path.join(BUILD + "-asan", "amaxd")
        self.history = []   # (daemon, pid, how it ended)

    def sock(self, i):
        return os.path.join(self.root, f"d{i}.sock")

    def log(self, i):
        return os.path.join(self.root, f"d{i}.log")

    def start(self, i, wait=True):
        coord = ",".join(f"127.0.0.1:{self.ports[k]}" for k in range(self.candidates))
        args = [self.exe, f"--socket={self.sock(i)}", f"--cluster_size={self.n}",
                f"--cluster_rank={i}", f"--coordinator={coord}",
                f"--peer_listen=127.0.0.1:{self.ports[i]}",
                f"--peer_advertise=127.0.0.1:{self.ports[i]}",
                f"--cluster_secret_file={self.secret}", "--gloo_host=127.0.0.1",
                "--backend=host", "--shm_dir=", "--log_level=info",
                f"--reconcile_timeout_ms={self.reconcile_timeout_ms}",
                f"--join_timeout_ms={JOIN_TIMEOUT_MS}"]
        if self.candidates > 1:
            args.append("--coordinator_failover_ms=1000")
        if self.state[i]:
            sd = os.path.join(self.root, f"state{i}")
            os.makedirs(sd, exist_ok=True)
            args.append(f"--state_dir={sd}")
        args += self.extra + list(self.extra_per.get(i, ()))
        lf = open(self.log(i), "a")
        lf.write(f"==== harness: start daemon {i} at {time.time():.3f}\n")
        lf.flush()
        self.procs[i] = subprocess.Popen(args, stdout=lf, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        lf.close()
        if wait:
            self.wait_ready(i)

    def wait_ready(self, i, timeout=15):
        t_end = time.time() + timeout
        while time.time() < t_end:
            try:
                with open(self.log(i)) as f:
                    txt = f.read()
                last = txt.rsplit("==== harness: start daemon", 1)[-1]
                if "main: ready" in last:
                    return True
            except FileNotFoundError:
                pass
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"daemon {i} exited {self.procs[i].returncode} at start")
            time.sleep(0.02)
        raise RuntimeError(f"daemon {i} not ready")

    def mark(self, i, text):
        with open(self.log(i), "a") as f:
            f.write(f"==== harness: {text} at {time.time():.3f}\n")

    def kill(self, i):
        p = self.procs[i]
        self.mark(i, "kill -9")
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        self.history.append((i, p.pid, "killed"))

    def stop(self, i):
        self.mark(i, "SIGSTOP")
        os.kill(self.procs[i].pid, signal.SIGSTOP)

    def cont(self, i):
        os.kill(self.procs[i].pid, signal.SIGCONT)
        self.mark(i, "SIGCONT")

    def restart(self, i):
        self.start(i)

    def alive(self, i):
        return self.procs[i] is not None and self.procs[i].poll() is None

    def shutdown(self):
        """SIGTERM every live daemon; returns {i: exit code} of those."""
        codes = {}
        for i, p in enumerate(self.procs):
            if p is None:
                continue
            if p.poll() is not None:
                codes[i] = ("exited-early", p.returncode)
                continue
            try:
                os.kill(p.pid, signal.SIGCONT)
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for i, p in enumerate(self.procs):
            if p is None or i in codes:
                continue
            try:
                codes[i] = ("term", p.wait(timeout=15))
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
                codes[i] = ("hung-on-term", None)
        return codes


class Run:
    """One job on one cluster with trainer processes."""

    def __init__(self, name, n_daemons, placement, state=(True,), epochs=EPOCHS, policy="follow",
                 candidates=1, asan=False, pace=0.02, extra_slack=0.0, extra_per=None,
                 reconcile_timeout_ms=RECONCILE_TIMEOUT_MS, cfg_extra=None):
        self.name = name
        self.root = tempfile.mkdtemp(prefix=f"amx-{name[:20]}-", dir="/tmp")
        self.ctl = os.path.join(self.root, "ctl")
        self.out = os.path.join(self.root, "out")
        os.makedirs(self.ctl)
        os.makedirs(self.out)
        self.W = len(placement)
        self.placement = placement            # rank -> daemon
        self.cluster = Cluster(self.root, n_daemons, state, candidates=candidates, asan=asan,
                               extra_per=extra_per, reconcile_timeout_ms=reconcile_timeout_ms)
        self.job = "chaos-job"
        self.cfg = {"W": self.W, "job": self.job, "epochs": epochs, "ctl": self.ctl,
                    "out": self.out, "policy": policy, "pace": pace, "extra_slack": extra_slack,
                    "sockets": {str(r): self.cluster.sock(d) for r, d in enumerate(placement)},
                    "reconcile_timeout_ms": reconcile_timeout_ms}
        self.cfg.update(cfg_extra or {})
        self.cfg_path = os.path.join(self.root, "cfg.json")
        json.dump(self.cfg, open(self.cfg_path, "w"))
        self.trainers = {}
        self.epochs = epochs

    def start(self):
        for i in range(self.cluster.n):
            self.cluster.start(i, wait=False)
        for i in range(self.cluster.n):
            self.cluster.wait_ready(i)
        for r in range(self.W):
            self.start_trainer(r)

    def start_trainer(self, r):
        self.trainers[r] = subprocess.Popen([PY, os.path.abspath(__file__), "trainer", self.cfg_path,
                                             str(r)], start_new_session=True,
                                            stdout=open(os.path.join(self.out, f"t{r}.stdout"), "a"),
                                            stderr=subprocess.STDOUT)

    def kill_trainer(self, r):
        p = self.trainers[r]
        os.kill(p.pid, signal.SIGKILL)
        p.wait()

    # holds
    def hold(self, r, phase, e):
        try:
            os.unlink(os.path.join(self.ctl, f"at.{r}"))
        except FileNotFoundError:
            pass
        with open(os.path.join(self.ctl, f"hold.{r}.tmp"), "w") as f:
            f.write(f"{phase} {e}")
        os.replace(os.path.join(self.ctl, f"hold.{r}.tmp"), os.path.join(self.ctl, f"hold.{r}"))

    def wait_at(self, r, phase, e, timeout=60):
        af = os.path.join(self.ctl, f"at.{r}")
        t_end = time.time() + timeout
        while time.time() < t_end:
            try:
                at = open(af).read().strip()
                if at == f"{phase} {e}" or (e == "*" and at.startswith(f"{phase} ")):
                    return at
            except FileNotFoundError:
                pass
            time.sleep(0.01)
        raise RuntimeError(f"rank {r} never reached {phase} {e}")

    def release(self, r):
        try:
            os.unlink(os.path.join(self.ctl, f"hold.{r}"))
        except FileNotFoundError:
            pass

    def wait_trainers(self, timeout=180):
        t_end = time.time() + timeout
        codes = {}
        for r, p in self.trainers.items():
            try:
                codes[r] = p.wait(timeout=max(1, t_end - time.time()))
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
                codes[r] = "killed-by-harness(timeout)"
        return codes

    def events(self):
        evs = []
        for r in range(self.W):
            try:
                with open(os.path.join(self.out, f"trainer.{r}.jsonl")) as f:
                    evs += [json.loads(l) for l in f if l.strip()]
            except FileNotFoundError:
                pass
        evs.sort(key=lambda x: x["t"])
        return evs

    def cleanup(self, keep=False):
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------- checking

CONTROL_CACHE = {}
KEEP = False


def control(n_daemons, placement, epochs, subst=None):
    key = (n_daemons, tuple(placement), epochs, json.dumps(subst, sort_keys=True))
    if key in CONTROL_CACHE:
        return CONTROL_CACHE[key]
    run = Run("control", n_daemons, placement, state=(False,), epochs=epochs)
    if subst:
        run.cfg["subst"] = subst
        json.dump(run.cfg, open(run.cfg_path, "w"))
    run.start()
    codes = run.wait_trainers()
    run.cluster.shutdown()
    exp = {}
    errs = [e for e in run.events() if e["ev"] in ("error", "exception", "gave_up", "slow")]
    for ev in run.events():
        if ev["ev"] == "answer":
            exp[(ev["rank"], ev["epoch"])] = ev["res"]
    ok = (not errs and all(c == 0 for c in codes.values())
          and len(exp) == len(placement) * epochs)
    if not ok:
        print(f"CONTROL RUN FAILED: {errs[:3]} codes={codes} n={len(exp)} dir={run.root}")
        sys.exit(2)
    bad = numpy_check(exp) if not subst else []
    if bad:
        print("FAIL control-vs-numpy: " + "; ".join(bad[:5]))
    run.cleanup()
    CONTROL_CACHE[key] = exp
    return exp


def numpy_check(exp):
    """Independent check of the control run with the documented formulas
    (FP8 current, TE output; NVFP4 global; MXFP8 byte) on what it answered."""
    bad = []
    f32 = np.float32
    for (r, e), res in exp.items():
        q = res["a.fc1.w"]
        a = np.frombuffer(bytes.fromhex(q["amax"]), "<f4")
        s = np.frombuffer(bytes.fromhex(q["scale"]), "<f4")
        si = np.frombuffer(bytes.fromhex(q["scale_inv"]), "<f4")
        want = np.where(a > 0, f32(448) / a, f32(1)).astype(f32)
        if not np.array_equal(want, s) or not np.array_equal((f32(1) / want).astype(f32), si):
            bad.append(f"a.fc1.w r{r} e{e}")
        q = res["c.nv"]
        g = struct.unpack("<f", bytes.fromhex(q["global_amax"]))[0]
        gs = struct.unpack("<f", bytes.fromhex(q["global_scale"]))[0]
        if g > 0 and f32(gs) != min(f32(2688) / f32(g), np.finfo(f32).max):
            bad.append(f"c.nv global r{r} e{e}")
        q = res["d.mx"]
        a = np.frombuffer(bytes.fromhex(q["amax"]), "<f4")
        bs = np.frombuffer(bytes.fromhex(q["block_scales"]), np.uint8)
        x = (a * f32(1.0 / 448)).astype(f32)
        bits = x.view(np.uint32)
        ex = (bits >> 23) & 0xff
        mant = bits & 0x7fffff
        want = np.where((mant != 0) & (ex != 0xfe) & (ex != 0), ex + 1, ex).astype(np.uint8)
        if not np.array_equal(want, bs):
            bad.append(f"d.mx r{r} e{e}")
    return bad


def diff_res(got, want):
    """Fields that differ (None: same).  `filled` is compared only when
    both sides know it (docs: restored results do not say)."""
    diffs = []
    for name in sorted(set(got) | set(want)):
        g, w = got.get(name), want.get(name)
        if g is None or w is None:
            diffs.append(f"{name}: {'missing in answer' if g is None else 'unexpected'}")
            continue
        for k in w:
            if k in ("peer_fill_known", "filled"):
                continue
            if g.get(k) != w[k]:
                diffs.append(f"{name}.{k}")
        if g.get("peer_fill_known") and w.get("peer_fill_known") and g.get("filled") != w.get("filled"):
            diffs.append(f"{name}.filled")
    return diffs


def sent_model(evs, rejoin_drops=False):
    """{"r:K": steps} for answers K whose contributions (from the trainer's
    sends since its previous answer) were not exactly step K's.
    rejoin_drops: a rejoined Join naming epoch J ends the sends of the
    killed trainer for epochs below J (they went into an epoch that was in
    flight, the docs' rule), so they are not counted into J."""
    since, out = {}, {}
    sent_ep = {}
    for ev in evs:
        r = ev["rank"]
        if ev["ev"] == "join" and rejoin_drops and ev.get("rejoined"):
            keep = {st for (ep, st) in sent_ep.get(r, set()) if ep >= ev["epoch"]}
            since[r] = keep
            sent_ep[r] = {(ep, st) for (ep, st) in sent_ep.get(r, set()) if ep >= ev["epoch"]}
        elif ev["ev"] == "sent":
            since.setdefault(r, set()).add(ev["step"])
            sent_ep.setdefault(r, set()).add((ev["epoch"], ev["step"]))
        elif ev["ev"] == "answer":
            if ev["src"] == "reconcile":
                st = since.get(r, set())
                if st and st != {ev["epoch"]}:
                    out[f"{r}:{ev['epoch']}"] = sorted(st)
            if rejoin_drops and ev["src"] == "getscales" and ev.get("why", "").startswith("rejoin"):
                continue   # the restarted trainer's extra reads end nothing it sent
            since[r] = set()
            sent_ep[r] = set()
    return out


def analyse(run, exp, allow_incomplete=False, note="", limitation=False, rejoin_drops=False):
    """Returns (fails, limits, info) lists of strings."""
    fails, limits, info = [], [], []
    evs = run.events()
    subst = sent_model(evs, rejoin_drops)
    alt = None
    per_rank_max = {r: 0 for r in range(run.W)}
    answers = 0
    for ev in evs:
        if ev["ev"] == "answer":
            answers += 1
            r, k = ev["rank"], ev["epoch"]
            if ev["src"] == "reconcile" and ev["req_epoch"] != k:
                (limits if limitation else fails).append(
                    f"EPOCH LABEL: rank {r} Reconcile(epoch={ev['req_epoch']}) answered epoch {k}")
            want = exp.get((r, k))
            if want is None:
                fails.append(f"rank {r} got an answer for epoch {k} ({ev['src']}) outside the control run")
                continue
            d = diff_res(ev["res"], want)
            if d and subst:
                if alt is None:
                    alt = control(run.cluster.n, run.placement, run.epochs, subst)
                wa = alt.get((r, k))
                if wa is not None and not diff_res(ev["res"], wa):
                    (limits if limitation else fails).append(
                        f"WRONG-EPOCH DATA rank {r} epoch {k} via {ev['src']}: differs from the "
                        f"uninterrupted run in {d[:4]}..., equals an uninterrupted run in which the "
                        f"trainers sent {subst} (rank:epoch -> steps whose values it sent)")
                    d = None
            if d:
                # which control epoch does it match, if any?
                other = [kk for (rr, kk), w in exp.items() if rr == r and not diff_res(ev["res"], w)]
                fails.append(f"SILENT WRONG ANSWER rank {r} epoch {k} via {ev['src']}"
                             f"{'(' + ev.get('why', '') + ')' if ev.get('why') else ''}"
                             f" at t={ev['t']:.3f}: differs in {d[:8]}{'...' if len(d) > 8 else ''}"
                             f"; matches control epoch(s) {other}")
            if ev["src"] == "reconcile":
                per_rank_max[r] = max(per_rank_max[r], k)
        elif ev["ev"] == "slow":
            fails.append(f"HANG/SLOW rank {ev['rank']} {ev['call']} took {ev['dur']:.1f}s "
                         f"(limit {ev['limit']:.1f}s)")
        elif ev["ev"] == "gave_up":
            fails.append(f"LIVENESS rank {ev['rank']} gave up at epoch {ev['epoch']}")
        elif ev["ev"] == "exception":
            fails.append(f"rank {ev['rank']} client exception in {ev['call']}: {ev['msg']}")
        elif ev["ev"] == "error":
            if ev["code"] in ("INTERNAL", "UNKNOWN", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"):
                fails.append(f"rank {ev['rank']} unexpected {ev['code']} from {ev['call']}: {ev['msg']}")
    done = {ev["rank"] for ev in evs if ev["ev"] == "done"}
    if not allow_incomplete:
        for r in range(run.W):
            if r not in done:
                fails.append(f"LIVENESS rank {r} did not finish (last answered epoch {per_rank_max[r]})")
    # errors summary
    codes = {}
    for ev in evs:
        if ev["ev"] == "error":
            codes[(ev["call"], ev["code"])] = codes.get((ev["call"], ev["code"]), 0) + 1
    info.append(f"answers={answers} errors={dict((f'{a}:{b}', n) for (a, b), n in codes.items())}")
    if subst:
        info.append(f"sent-other-steps={subst}")
    return fails, limits, info


def scan_logs(run):
    bad = []
    for i in range(run.cluster.n):
        try:
            txt = open(run.cluster.log(i), errors="replace").read()
        except FileNotFoundError:
            continue
        for pat in ("AddressSanitizer", "runtime error:", "Assertion", "SIGSEGV", "Segmentation",
                    "terminate called", "LeakSanitizer", " fatal ", "abort"):
            for line in txt.splitlines():
                if pat in line and "harness" not in line and "aborted in" not in line \
                        and "ABORTED" not in line and "Abort" not in line and "abort(" not in line \
                        and "aborts" not in line and "aborted" not in line:
                    bad.append(f"daemon {i} log: {line.strip()[:200]}")
    return bad[:10]


def error_lines(run, limit=12):
    out = []
    for i in range(run.cluster.n):
        try:
            for line in open(run.cluster.log(i), errors="replace"):
                if " error " in line or "harness" in line:
                    out.append(f"d{i}: {line.rstrip()[:260]}")
        except FileNotFoundError:
            pass
    return out


# ---------------------------------------------------------------- scenarios

def holdall(run, phase, e, ranks=None):
    ranks = range(run.W) if ranks is None else ranks
    for r in ranks:
        run.hold(r, phase, e)


def wait_all(run, phase, e, ranks):
    for r in ranks:
        run.wait_at(r, phase, e)


def ranks_on(run, d):
    return [r for r, dd in enumerate(run.placement) if dd == d]


def f_kill_daemon_at(d, phase, e=3, which="all", down=0.3, stop=False, stop_s=None):
    """Hold the chosen ranks at (phase, e); the others run into the epoch
    (they end up waiting in Reconcile). Kill -9 (or SIGSTOP) daemon d, bring
    it back, release."""
    def f(run):
        if which == "all":
            held = list(range(run.W))
        elif which == "on":     # ranks of daemon d held, others free
            held = ranks_on(run, d)
        elif which == "off":    # ranks of other daemons held, d's free
            held = [r for r in range(run.W) if run.placement[r] != d]
        elif which == "one-off":  # one rank of another daemon held (everyone else waits in Reconcile)
            held = [[r for r in range(run.W) if run.placement[r] != d][0]]
        elif which == "one-on":
            held = [ranks_on(run, d)[0]]
        else:
            raise ValueError(which)
        holdall(run, phase, e, held)
        wait_all(run, phase, e, held)
        time.sleep(0.6)  # the free ranks go on into Reconcile and wait there
        if stop:
            run.cluster.stop(d)
            time.sleep(stop_s)
            run.cluster.cont(d)
        else:
            run.cluster.kill(d)
            time.sleep(down)
            run.cluster.restart(d)
        for r in held:
            run.release(r)
    return f


def f_kill_trainer(r, phase, e=3, down=0.2):
    def f(run):
        run.hold(r, phase, e)
        run.wait_at(r, phase, e)
        time.sleep(0.4)
        run.kill_trainer(r)
        run.release(r)
        time.sleep(down)
        run.start_trainer(r)
    return f


def daemon_status(run, d, rank):
    """Status of the job on daemon d (an extra client; Status needs no Join)."""
    import amaxd
    c = amaxd.Client(run.job, rank, run.W, socket=run.cluster.sock(d), timeout=5.0)
    try:
        jobs = c.status(run.job).jobs
        return jobs[0] if jobs else None
    finally:
        c.close()


def f_kill_trainer_inflight(r, when, delay, e=3):
    """Kill -9 rank r's trainer while it waits inside Reconcile(e) and its
    daemon's epoch e is in flight: every local rank of that daemon entered
    Reconcile, one rank `h` of another daemon is held before its Reconcile(e).
    A new trainer for r starts (Join, the epoch Join names, SendAmax,
    Reconcile: docs/API.md, "a rank calls Join again after the job is ready").
    h is released
      before-join    `delay` s before the new trainer's Join,
      after-send     `delay` s before its Reconcile (it has sent),
      in-reconcile   `delay` s after its Reconcile started,
      late           past the flight's deadline (reconcile_timeout_ms after
                     the daemon's ranks entered): the flight fails.
    Sets run.notes (checked by check_inflight)."""
    def f(run):
        d = run.placement[r]
        h = [x for x in range(run.W) if run.placement[x] != d][0]
        run.notes = {"r": r, "h": h, "d": d, "e": e, "when": when}
        run.hold(h, "reconcile", e)
        run.wait_at(h, "reconcile", e)
        # every other rank sent for e and entered Reconcile(e)
        others = [x for x in range(run.W) if x != h]
        t_end = time.time() + 30
        while time.time() < t_end:
            sent = {ev["rank"] for ev in run.events() if ev["ev"] == "sent" and ev["epoch"] == e}
            if all(x in sent for x in others):
                break
            time.sleep(0.02)
        time.sleep(0.5)
        t_in = time.time()
        st = daemon_status(run, d, r)
        run.notes["before_kill"] = (st.epoch, st.in_flight, st.ranks_in_reconcile) if st else None
        run.kill_trainer(r)
        time.sleep(0.2)
        st = daemon_status(run, d, r)
        run.notes["after_kill"] = (st.epoch, st.in_flight, st.ranks_in_reconcile) if st else None
        if when == "before-join":
            run.hold(r, "join", None)
            run.start_trainer(r)
            run.wait_at(r, "join", None)
            run.release(h)
            time.sleep(delay)
            run.release(r)
        elif when in ("after-send", "in-reconcile"):
            run.hold(r, "reconcile", "*")
            run.start_trainer(r)
            try:
                # a build whose Join waits for the flight to end (docs changed on 2026-11-27)
                # never gets there while h is held: then h is released while Join waits
                run.notes["new_at"] = run.wait_at(r, "reconcile", "*", timeout=3.0)
            except RuntimeError:
                run.notes["new_at"] = "join still waiting 3 s after the start: h released"
                run.release(h)
                run.notes["new_at_after"] = run.wait_at(r, "reconcile", "*")
            if when == "after-send":
                run.release(h)
                time.sleep(delay)
                run.release(r)
            else:
                run.release(r)
                time.sleep(delay)
                run.release(h)
        elif when == "late":
            run.hold(r, "reconcile", "*")
            run.start_trainer(r)
            run.notes["new_at"] = run.wait_at(r, "reconcile", "*")
            run.release(r)
            # the flight's deadline: the earliest reconcile_timeout_ms of its ranks
            time.sleep(max(0.0, t_in - 0.5 + run.cluster.reconcile_timeout_ms / 1000 + delay - time.time()))
            st = daemon_status(run, d, r)
            run.notes["at_release"] = (st.epoch, st.in_flight, st.ranks_in_reconcile) if st else None
            run.release(h)
        else:
            raise ValueError(when)
    return f


def check_inflight(run):
    """The docs' promises about the re-join itself (the answers are checked by analyse)."""
    n = getattr(run, "notes", None)
    if not n:
        return ["fault script set no notes"]
    fails = []
    r, e = n["r"], n["e"]
    bk = n.get("before_kill")
    if not bk or bk[0] != e or not bk[1]:
        fails.append(f"SETUP: daemon {n['d']}'s epoch {e} was not in flight at the kill "
                     f"(Status epoch, in_flight, ranks_in_reconcile = {bk})")
    evs = [ev for ev in run.events() if ev["rank"] == r]
    pids = []
    for ev in evs:
        if ev["ev"] == "start":
            pids.append(ev["pid"])
    if len(pids) < 2:
        return fails + ["SETUP: no second trainer started"]
    new = [ev for ev in evs if ev["pid"] == pids[-1]]
    joins = [ev for ev in new if ev["ev"] == "join"]
    if not joins:
        fails.append(f"new trainer of rank {r} logged no Join")
    else:
        j = joins[0]
        # docs: rejoined = true and the epoch SendAmax adds to: e + 1 while e is in flight
        # (API.md before 2026-11-27's change) or once e has ended; the docs as changed on
        # 2026-11-27 (Join waits for the flight to end) also allow e once the flight failed
        ok_epochs = (e, e + 1) if n["when"] == "late" else (e + 1,)
        n["new_join"] = (j["rejoined"], j["epoch"], round(j["dur"], 2))
        if not j["rejoined"] or j["epoch"] not in ok_epochs:
            fails.append(f"JOIN: new trainer of rank {r} got rejoined={j['rejoined']} epoch={j['epoch']}, "
                         f"docs: rejoined=true epoch in {ok_epochs}")
    first = [ev for ev in new if ev["ev"] == "answer" and ev["src"] == "reconcile"]
    errs = [f"{ev['call']}:{ev['code']}" for ev in new if ev["ev"] == "error"]
    n["new_first_answer"] = (first[0]["req_epoch"], first[0]["epoch"]) if first else None
    n["new_errors"] = errs
    n["new_reads"] = [(ev["why"], ev["epoch"]) for ev in new if ev["ev"] == "answer" and ev["src"] == "getscales"]
    if n["when"] != "late" and errs:
        # the flight ended normally: nothing in the docs makes the new trainer see an error
        fails.append(f"new trainer of rank {r} got errors {errs} (the flight was not failed)")
    return fails


def f_kill_at_epoch_end(d, e, delay):
    """Hold the last rank before Reconcile of epoch e; release it and kill
    daemon d `delay` s later (around the collective / snapshot / answers)."""
    def f(run):
        last = run.W - 1
        run.hold(last, "reconcile", e)
        run.wait_at(last, "reconcile", e)
        time.sleep(0.6)
        run.release(last)
        time.sleep(delay)
        run.cluster.kill(d)
        time.sleep(0.3)
        run.cluster.restart(d)
    return f


def f_kill_all(e=3, phase="reconcile", which_held=None):
    def f(run):
        held = [run.W - 1] if which_held is None else which_held
        holdall(run, phase, e, held)
        wait_all(run, phase, e, held)
        time.sleep(0.6)
        for d in range(run.cluster.n):
            run.cluster.kill(d)
        time.sleep(0.3)
        for d in range(run.cluster.n):
            run.cluster.start(d, wait=False)
        for d in range(run.cluster.n):
            run.cluster.wait_ready(d)
        for r in held:
            run.release(r)
    return f


def f_kill_during_rejoin(d, e=3, delay=0.3):
    """Kill daemon d while ranks are waiting in Reconcile; restart it and
    kill it again `delay` s after it is ready (trainers are re-joining /
    registering), then restart it for good."""
    def f(run):
        held = [[r for r in range(run.W) if run.placement[r] != d][0]]
        holdall(run, "reconcile", e, held)
        wait_all(run, "reconcile", e, held)
        time.sleep(0.5)
        run.cluster.kill(d)
        time.sleep(0.2)
        run.cluster.restart(d)
        for r in held:
            run.release(r)
        time.sleep(delay)
        run.cluster.kill(d)
        time.sleep(0.2)
        run.cluster.restart(d)
    return f


def f_random(seed, n_faults=3, roles=("member", "coord", "trainer"), horizon=(0.2, 2.5)):
    def f(run):
        rng = random.Random(seed)
        for _ in range(n_faults):
            time.sleep(rng.uniform(*horizon))
            role = rng.choice(roles)
            if role == "trainer":
                r = rng.randrange(run.W)
                run.kill_trainer(r)
                time.sleep(rng.uniform(0, 0.5))
                run.start_trainer(r)
            elif role == "stop":
                d = rng.randrange(run.cluster.n)
                run.cluster.stop(d)
                time.sleep(RECONCILE_TIMEOUT_MS / 1000 + rng.uniform(0.5, 2))
                run.cluster.cont(d)
            else:
                d = 0 if role == "coord" else rng.randrange(1, run.cluster.n)
                run.cluster.kill(d)
                time.sleep(rng.uniform(0, 0.8))
                run.cluster.restart(d)
    return f


P2 = [0, 1, 0, 1]          # 2 daemons, TP pairs span daemons
P3 = [0, 1, 1, 2, 2, 0]    # 3 daemons, 6 ranks (tp=2, ep=3)
P3m = [1, 2, 1, 2]         # 3 daemons, the coordinator hosts no rank


def scenarios():
    S = []
    for st_name, st in (("state", (True,)), ("nostate-member", (True, False)),
                        ("nostate-coord", (False, True))):
        for d, dn in ((1, "member"), (0, "coord")):
            if st_name == "nostate-member" and d == 0:
                continue
            if st_name == "nostate-coord" and d == 1:
                continue
            for pol in (("own", "follow") if st_name.startswith("nostate") else ("follow",)):
                pre = st_name if pol == "own" or not st_name.startswith("nostate") else st_name + "+follow"
                o = {"policy": pol, "limitation": st_name.startswith("nostate")}
                if pol == "follow" and st_name.startswith("nostate"):
                    # the limitation, shown once: trainers send the values of the epoch the
                    # state-less daemon numbers
                    S.append((f"{pre}/kill-{dn}/before-send", 2, P2, st,
                              f_kill_daemon_at(d, "send", 3, "all"), o))
                    continue
                for phase, which, pn in (("send", "all", "before-send"),
                                         ("reconcile", "on", "after-send-before-reconcile"),
                                         ("reconcile", "one-off", "while-others-wait-in-reconcile"),
                                         ("reconcile", "one-on", "while-others-wait-in-reconcile-own"),
                                         ("after", "all", "between-epochs")):
                    S.append((f"{pre}/kill-{dn}/{pn}", 2, P2, st, f_kill_daemon_at(d, phase, 3, which), o))
                S.append((f"{pre}/stop-{dn}/while-waiting", 2, P2, st,
                          f_kill_daemon_at(d, "reconcile", 3, "one-off", stop=True,
                                           stop_s=RECONCILE_TIMEOUT_MS / 1000 + 1.5), o))
                for delay in (0.0, 0.003, 0.006, 0.01, 0.015, 0.03, 0.1):
                    S.append((f"{pre}/kill-{dn}/epoch-end+{delay}", 2, P2, st,
                              f_kill_at_epoch_end(d, 3, delay), o))
                S.append((f"{pre}/kill-{dn}/during-rejoin", 2, P2, st, f_kill_during_rejoin(d), o))
    for phase in ("join", "send", "reconcile", "after"):
        S.append((f"state/kill-trainer/{phase}", 2, P2, (True,),
                  f_kill_trainer(1, phase, 3 if phase != "join" else None), {}))
    S.append(("state/kill-all/while-waiting", 2, P2, (True,), f_kill_all(), {}))
    S.append(("nostate/kill-all/while-waiting", 2, P2, (False,), f_kill_all(), {"policy": "own", "limitation": True}))
    for d, dn in ((1, "member"), (0, "coord")):
        S.append((f"snapint/kill-{dn}/between-epochs", 2, P2, (True,),
                  f_kill_daemon_at(d, "after", 4, "all"),
                  {"extra_per": {d: ["--snapshot_interval_ms=600000"]}}))
        S.append((f"snapint/kill-{dn}/while-waiting", 2, P2, (True,),
                  f_kill_daemon_at(d, "reconcile", 4, "one-off"),
                  {"extra_per": {d: ["--snapshot_interval_ms=600000"]}}))
    S.append(("state3/kill-member/while-waiting", 3, P3, (True,), f_kill_daemon_at(2, "reconcile", 3, "one-off"), {}))
    S.append(("state3/kill-coord/while-waiting", 3, P3, (True,), f_kill_daemon_at(0, "reconcile", 3, "one-off"), {}))
    S.append(("state3/stop-member/while-waiting", 3, P3, (True,),
              f_kill_daemon_at(1, "reconcile", 3, "one-off", stop=True, stop_s=4.5), {}))
    S.append(("state3/stop-coord/while-waiting", 3, P3, (True,),
              f_kill_daemon_at(0, "reconcile", 3, "one-off", stop=True, stop_s=4.5), {}))
    S.append(("state3-noranks-coord/kill-coord/while-waiting", 3, P3m, (True,),
              f_kill_daemon_at(0, "reconcile", 3, "all"), {}))
    S.append(("state3-noranks-coord/stop-coord/while-waiting", 3, P3m, (True,),
              f_kill_daemon_at(0, "reconcile", 3, "all", stop=True, stop_s=4.5), {}))
    for delay in (0.003, 0.008, 0.015):
        S.append((f"state3/kill-member/epoch-end+{delay}", 3, P3, (True,), f_kill_at_epoch_end(2, 3, delay), {}))
        S.append((f"state3/kill-coord/epoch-end+{delay}", 3, P3, (True,), f_kill_at_epoch_end(0, 3, delay), {}))
    return S


def rejoin_inflight_scenarios():
    """A trainer killed inside Reconcile while its daemon's epoch is in flight;
    its restart re-joins (docs/API.md Join row). 2 daemons, P2: rank 1 is on
    the member daemon 1, rank 0 on the coordinator's daemon 0."""
    S = []
    for st_name, st in (("state", (True,)), ("nostate", (False,))):
        for r, rn in ((1, "member"), (0, "coord")):
            for when, delay in (("before-join", 0.0), ("before-join", 0.3), ("after-send", 0.0),
                                ("after-send", 0.3), ("in-reconcile", 0.3), ("late", 0.5)):
                nm = f"rejoin-inflight/{st_name}/kill-trainer-{rn}/{when}" + \
                    (f"+{delay}" if when != "late" else "")
                S.append((nm, 2, P2, st, f_kill_trainer_inflight(r, when, delay),
                          {"rt_ms": 8000, "rejoin_drops": True, "check": check_inflight,
                           "cfg": {"getscales_on_rejoin": True}}))
    return S


def random_scenarios(trials, seed0=1000):
    S = []
    for t in range(trials):
        seed = seed0 + t
        st = [(True,), (True, False), (False, True)][t % 3]
        stn = ["state", "nostate-member", "nostate-coord"][t % 3]
        roles = ("member", "coord", "trainer", "stop")
        S.append((f"random/{stn}/seed{seed}", 2 + (t % 2), P2 if t % 2 == 0 else P3, st,
                  f_random(seed, n_faults=3, roles=roles, horizon=(0.3, 2.0)),
                  {"policy": "own", "limitation": stn != "state", "epochs": 30, "pace": 0.5}))
    return S


def run_scenario(name, nd, placement, state, fault, opts, keep_failed=True, asan=False):
    ep = opts.get("epochs", EPOCHS)
    exp = control(nd, placement, ep)
    run = Run(name.replace("/", "_"), nd, placement, state=state, policy=opts.get("policy", "follow"),
              asan=asan, extra_per=opts.get("extra_per"), epochs=ep, pace=opts.get("pace", 0.02),
              reconcile_timeout_ms=opts.get("rt_ms", RECONCILE_TIMEOUT_MS), cfg_extra=opts.get("cfg"))
    t0 = time.time()
    fault_err = None
    try:
        run.start()
        try:
            fault(run)
        except Exception as ex:  # noqa
            fault_err = f"{ex!r}"
            for r in range(run.W):
                run.release(r)
        run.wait_trainers(timeout=80)
    finally:
        dcodes = run.cluster.shutdown()
    fails, limits, info = analyse(run, exp, limitation=opts.get("limitation", False),
                                  rejoin_drops=opts.get("rejoin_drops", False))
    if opts.get("check"):
        fails += opts["check"](run)
    if fault_err:
        fails.append(f"fault script did not complete: {fault_err}")
    for i, (how, code) in dcodes.items():
        if how != "term" or code != 0:
            fails.append(f"daemon {i} ended {how} code {code}")
    fails += scan_logs(run)
    dur = time.time() - t0
    status = "PASS" if not fails else "FAIL"
    if not fails and limits:
        status = "LIMITATION"
    print(f"{status} {name} ({dur:.1f}s) {' '.join(info)}", flush=True)
    if getattr(run, "notes", None):
        print(f"    notes: {run.notes}", flush=True)
    for f_ in fails[:12]:
        print(f"    - {f_}", flush=True)
    for f_ in limits[:6]:
        print(f"    - documented-limitation: {f_[:400]}", flush=True)
    if fails:
        print(f"    kept: {run.root}", flush=True)
        for l in error_lines(run)[:25]:
            print(f"      {l}")
    if (not fails or not keep_failed) and not KEEP:
        run.cleanup()
    elif KEEP:
        print(f"    kept: {run.root}")
    return (not fails), bool(limits), run.root


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "trainer":
        sys.exit(trainer_main(sys.argv[2], int(sys.argv[3])))
    ap = argparse.ArgumentParser()
    ap.add_argument("patterns", nargs="*")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--trials", type=int, default=0, help="random-fault trials to add")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--policy", default="follow")
    ap.add_argument("--asan", action="store_true")
    ap.add_argument("--keep", action="store_true")
    a = ap.parse_args()
    global KEEP
    KEEP = a.keep
    S = scenarios() + rejoin_inflight_scenarios() + random_scenarios(a.trials)
    if a.patterns:
        S = [s for s in S if any(re.search(p, s[0]) for p in a.patterns)]
    if a.list:
        for s in S:
            print(s[0])
        return
    nfail = nlim = 0
    for _ in range(a.repeat):
        for name, nd, pl, st, fault, opts in S:
            ok, lim, _ = run_scenario(name, nd, pl, st, fault, opts, asan=a.asan)
            nfail += 0 if ok else 1
            nlim += 1 if (ok and lim) else 0
    print(f"documented-limitation scenarios (no state_dir on the restarted daemon): {nlim}")
    print(f"overall: {nfail} failed")
    sys.exit(1 if nfail else 0)


if __name__ == "__main__":
    main()
