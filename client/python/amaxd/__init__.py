"""Python client of amaxd, the amax calibration daemon.

    import amaxd
    with amaxd.Client("llama-70b", rank, world_size) as c:
        c.join()
        c.register([amaxd.Quantizer("layers.0.fc1.weight_quantizer", [8192],
                                    amaxd.Recipe.fp8_current(),
                                    amaxd.placement.column_parallel([8192], tp_rank, tp))])
        c.send({"layers.0.fc1.weight_quantizer": local_amax})
        scales = c.reconcile()

Modules, bottom to top (each imports only those below it; tests/e2e/test_package.py
checks it):
    errors      typed exceptions, one per gRPC status
    placement   where a rank's block lies (Placement and the Megatron helpers)
    _gen        amaxd_pb2, generated from proto/ at build time
    types       Recipe, Calibrator, Quantizer, Masked, Stat, Result, format constants, array conversions
    tiles       the tiles a flat-sharded weight's range touches (amaxd.tiles)
    calib       a rank's histogram counts and MSE-search losses for a calibrator (amaxd.calib)
    wire        every hand-written protobuf codec (Register, SendPacked, ReconcilePacked, health)
    transport   the gRPC channel, errors mapped once, shared-memory buffers
    export      the safetensors file of Client.export
    packed      Layout and PackedResult, the packed per-rank form
    client      Client
    modelopt    the ModelOpt adapter (amaxd.modelopt)
    te          TransformerEngine's master-weight cast through amaxd (amaxd.te)
    demo        python -m amaxd.demo
"""
from . import calib, errors, placement
from ._gen import amaxd_pb2 as pb
from .client import Client
from .errors import AmaxdError
from .packed import Layout, PackedResult
from .placement import Placement
from .types import (FP8_E4M3, FP8_E5M2, MXFP8, NVFP4, PER_EPOCH, RUNNING_MAX, Calibrator, Masked,
                    Quantizer, Recipe, Result, Stat)

__version__ = "0.1.0"
__all__ = ["Client", "Quantizer", "Recipe", "Calibrator", "Stat", "Result", "Masked", "Layout",
           "PackedResult", "Placement",
           "AmaxdError", "errors", "calib",
           "placement", "pb", "FP8_E4M3", "FP8_E5M2", "NVFP4", "MXFP8", "RUNNING_MAX", "PER_EPOCH"]
