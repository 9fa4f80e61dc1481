"""Python client of amaxd, the amax calibration daemon.

    import amaxd
    with amaxd.Client("llama-70b", rank, world_size) as c:
        c.join()
        c.register([amaxd.Quantizer("layers.0.fc1.weight_quantizer", [8192],
                                    amaxd.Recipe.fp8_current(),
                                    amaxd.placement.column_parallel([8192], tp_rank, tp))])
        c.send({"layers.0.fc1.weight_quantizer": local_amax})
        scales = c.reconcile()
"""
from . import errors, placement
from ._gen import amaxd_pb2 as pb
from .client import Client
from .errors import AmaxdError
from .packed import Layout, PackedResult
from .placement import Placement
from .types import (FP8_E4M3, FP8_E5M2, MXFP8, NVFP4, PER_EPOCH, RUNNING_MAX, Masked, Quantizer,
                    Recipe, Result)

__version__ = "0.1.0"
__all__ = ["Client", "Quantizer", "Recipe", "Result", "Masked", "Layout", "PackedResult", "Placement",
           "AmaxdError", "errors",
           "placement", "pb", "FP8_E4M3", "FP8_E5M2", "NVFP4", "MXFP8", "RUNNING_MAX", "PER_EPOCH"]
