"""Trainer-rank processes for the end-to-end tests (started with spawn).

A toy model layer, identical for every layout:
  fc1.weight      [8, 16]  column-parallel: output rows split over TP
  fc2.weight      [6, 12]  row-parallel: input columns split over TP
  fc1.input       activations, one batch per DP rank
  experts.fc2.in  4 experts, EP over the DP dimension; expert 3 gets no tokens
Each rank computes the amax of what it holds and sends it with its placement.
"""
import numpy as np

import amaxd
from amaxd import placement as P

E = 4


def model(seed=1234):
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((8, 16)).astype(np.float32) * 3
    w2 = rng.standard_normal((6, 12)).astype(np.float32)
    x = [rng.standard_normal((5, 16)).astype(np.float32) * (d + 1) for d in range(2)]
    tokens = [rng.standard_normal((7, 16)).astype(np.float32) * (e + 2) for e in range(E - 1)] + [None]
    return w1, w2, x, tokens


def quantizers(tp_rank, tp, ep_rank, ep):
    return [
        amaxd.Quantizer("layer0.fc1.weight_quantizer", [8], amaxd.Recipe.fp8_current(),
                        P.column_parallel([8], tp_rank, tp)),
        amaxd.Quantizer("layer0.fc2.weight_quantizer", [6], amaxd.Recipe.mxfp8(),
                        P.row_parallel([6], tp_rank, tp)),
        amaxd.Quantizer("layer0.fc1.input_quantizer", [], amaxd.Recipe.nvfp4()),
        amaxd.Quantizer("layer0.experts.fc2.input_quantizer", [E],
                        amaxd.Recipe.fp8_current(amaxd.FP8_E5M2), P.per_expert(E, ep_rank, ep),
                        peer_group="layer0.experts.fc2.input"),
    ]


def local_amax(tp_rank, tp, dp_rank, dp):
    """What one rank of a TP x DP layout measures (EP = DP)."""
    w1, w2, x, tokens = model()
    r1 = 8 // tp
    c2 = 12 // tp
    amax = {
        "layer0.fc1.weight_quantizer": np.abs(w1[tp_rank * r1:(tp_rank + 1) * r1]).max(axis=1),
        "layer0.fc2.weight_quantizer": np.abs(w2[:, tp_rank * c2:(tp_rank + 1) * c2]).max(axis=1),
    }
    # A rank sees its DP shard of the batch (all of it when dp == 1).
    batches = x[dp_rank::dp] if dp > 1 else x
    amax["layer0.fc1.input_quantizer"] = max(float(np.abs(b).max()) for b in batches)
    per = E // dp
    experts = range(dp_rank * per, (dp_rank + 1) * per)
    vals = np.array([np.abs(tokens[e]).max() if tokens[e] is not None else 0 for e in experts],
                    dtype=np.float32)
    mask = np.array([tokens[e] is None for e in experts])
    amax["layer0.experts.fc2.input_quantizer"] = np.ma.masked_array(vals, mask=mask)
    return amax


def run_rank(socket, job, rank, tp, dp):
    """One trainer rank: join, register, send, reconcile; returns results as bytes."""
    tp_rank, dp_rank = rank % tp, rank // tp
    with amaxd.Client(job, rank, tp * dp, socket=socket, timeout=60) as c:
        c.join()
        c.register(quantizers(tp_rank, tp, dp_rank, dp))
        c.send(local_amax(tp_rank, tp, dp_rank, dp))
        res = c.reconcile()
        whole = c.get_scales(whole=True)
    pack = lambda d: {n: (r.offset, r.shape, r.amax.tobytes(), r.scale.tobytes(), r.scale_inv.tobytes(),
                          r.block_scales.tobytes(), r.global_amax, r.global_scale, r.global_scale_inv,
                          r.missing) for n, r in d.items()}
    return pack(res), pack(whole)
