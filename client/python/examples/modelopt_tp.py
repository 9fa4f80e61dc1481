"""Two tensor-parallel ranks calibrate their shards of an MLP with ModelOpt
(NVFP4), then amaxd.modelopt reconciles them: afterwards both ranks hold the
amax a single-process calibration of the whole MLP gives, and ModelOpt's
export computes the same scales from them.

    AMAXD_SOCKET=/tmp/amaxd.sock python client/python/examples/modelopt_tp.py

(needs torch and nvidia-modelopt, and a running amaxd on that socket.)
"""
import multiprocessing as mp

import torch
import torch.nn as nn

TP, H, FF = 2, 64, 256


class MLP(nn.Module):
    def __init__(self, ff):
        super().__init__()
        self.up_proj = nn.Linear(H, ff, bias=False)  # column-parallel: output rows split over TP
        self.down_proj = nn.Linear(ff, H, bias=False)  # row-parallel: input columns split over TP

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)))


def weights_and_data():
    torch.manual_seed(0)
    return MLP(FF), torch.randn(32, H) * 4


def rank(r):
    import modelopt.torch.quantization as mtq

    import amaxd
    import amaxd.modelopt as amo

    full, x = weights_and_data()
    shard = MLP(FF // TP)  # this rank's shard
    with torch.no_grad():
        shard.up_proj.weight.copy_(full.up_proj.weight.chunk(TP, dim=0)[r])
        shard.down_proj.weight.copy_(full.down_proj.weight.chunk(TP, dim=1)[r])
    # Calibrate the shard locally: no torch.distributed, no process group.
    mtq.quantize(shard, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    with amaxd.Client("modelopt-example", r, TP) as c:
        c.join()
        amo.sync(c, shard, amo.Layout(tp_rank=r, tp_size=TP))  # register, send, reconcile, write back
    return {n: float(q.amax) for n, q in shard.named_modules()
            if n.endswith("_quantizer") and getattr(q, "_amax", None) is not None}


def single_process():
    import modelopt.torch.quantization as mtq

    full, x = weights_and_data()
    mtq.quantize(full, mtq.NVFP4_DEFAULT_CFG, lambda m: m(x))
    return {n: float(q.amax) for n, q in full.named_modules()
            if n.endswith("_quantizer") and getattr(q, "_amax", None) is not None}


if __name__ == "__main__":
    with mp.get_context("spawn").Pool(TP) as pool:
        ranks = pool.map(rank, range(TP))
    want = single_process()
    for name in sorted(want):
        print(f"{name:30s} rank 0 {ranks[0][name]:.9g}  rank 1 {ranks[1][name]:.9g}  "
              f"single process {want[name]:.9g}")
    assert all(r == want for r in ranks), "the ranks differ from the single process"
    print("both ranks hold the single-process amax")
