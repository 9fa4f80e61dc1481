"""A short demo job: two tensor-parallel trainer ranks (threads) calibrate a
toy MoE layer against a running amaxd and print the reconciled scales.

    python -m amaxd.demo --socket /tmp/amaxd.sock
"""
import argparse
import threading
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import Client, Quantizer, Recipe
from . import placement as P
from .types import FP8_E4M3, Result

TP = 2
EXPERTS = 4


def layer(rank: int, tp: int) -> List[Quantizer]:
    return [
        Quantizer("decoder.layers.0.self_attention.linear_qkv.weight_quantizer", [12],
                  Recipe.fp8_current(FP8_E4M3), P.column_parallel([12], rank, tp)),
        Quantizer("decoder.layers.0.self_attention.linear_proj.weight_quantizer", [8],
                  Recipe.mxfp8(), P.row_parallel([8], rank, tp)),
        Quantizer("decoder.layers.0.mlp.linear_fc1.input_quantizer", [], Recipe.nvfp4()),
        Quantizer("decoder.layers.0.mlp.experts.linear_fc2.input_quantizer", [EXPERTS],
                  Recipe.fp8_delayed(), P.per_expert(EXPERTS, rank, tp),
                  peer_group="decoder.layers.0.mlp.experts.linear_fc2.input"),
    ]


def rank_main(socket: Optional[str], job: str, rank: int,
              results: Dict[int, Dict[str, Result]], epochs: int) -> None:
    rng = np.random.default_rng(100 + rank)
    with Client(job, rank, TP, socket=socket, timeout=60) as c:
        c.join()
        c.register(layer(rank, TP))
        for _ in range(epochs):
            experts = np.abs(rng.standard_normal(EXPERTS // TP)).astype(np.float32) * 3
            # Expert 3 (on rank 1) receives no tokens: its amax comes from its peers.
            no_tokens = np.array([rank * (EXPERTS // TP) + i == 3 for i in range(EXPERTS // TP)])
            c.send({
                "decoder.layers.0.self_attention.linear_qkv.weight_quantizer":
                    np.abs(rng.standard_normal(6)).astype(np.float32),
                "decoder.layers.0.self_attention.linear_proj.weight_quantizer":
                    np.abs(rng.standard_normal(8)).astype(np.float32) * 100,
                "decoder.layers.0.mlp.linear_fc1.input_quantizer": float(rng.uniform(1, 20)),
                "decoder.layers.0.mlp.experts.linear_fc2.input_quantizer":
                    np.ma.masked_array(experts, mask=no_tokens),
            })
            c.reconcile()
        results[rank] = c.get_scales(whole=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=None, help="daemon socket (default $AMAXD_SOCKET)")
    ap.add_argument("--job", default="demo")
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args(argv)
    results: Dict[int, Dict[str, Result]] = {}
    threads = [threading.Thread(target=rank_main, args=(args.socket, args.job, r, results,
                                                        args.epochs)) for r in range(TP)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(results) != TP:
        raise SystemExit("demo: a rank failed (see above)")
    same = all(
        results[0][n].scale.tobytes() == results[r][n].scale.tobytes() for r in range(TP)
        for n in results[0])
    print(f"job {args.job!r}: {TP} TP ranks, {args.epochs} epochs reconciled; "
          f"scales bit-identical on every rank: {same}")
    for name, r in results[0].items():
        short = name.replace("decoder.layers.0.", "")
        print(f"\n{short}  shape {list(r.shape)}  global_amax {r.global_amax:.6g}  "
              f"global_scale {r.global_scale:.6g}")
        print(f"  amax      {np.array2string(r.amax, precision=4)}")
        print(f"  scale     {np.array2string(r.scale, precision=4)}")
        if r.block_scales.any():
            print(f"  bytes     {[hex(b) for b in r.block_scales.reshape(-1)]}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
