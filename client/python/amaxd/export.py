"""A job's reconciled scales as a safetensors file (the format checkpoints
already use; https://github.com/huggingface/safetensors, "Format").

Per quantizer NAME (whole global tensors, the last reconciled epoch):

  NAME.amax, NAME.scale, NAME.scale_inv        float32, the quantizer's global shape
  NAME.block_scale                             uint8 (NVFP4: E4M3 bits, MXFP8: E8M0 bits)
  NAME.global_amax, NAME.global_scale,
  NAME.global_scale_inv                        float32 scalars, or for a quantizer
                                               with global_axes k > 0 one per
                                               slice: shape global_shape[:k]

`__metadata__` holds "amaxd.format" ("scales/1"), the job, the epoch and
"amaxd.quantizers": a JSON list of {name, shape, format, block_scale} (and
"global_axes": k when k > 0) where format is fp8_e4m3 | fp8_e5m2 | nvfp4 |
mxfp8 and block_scale e4m3 | e8m0 | "" ; a quantizer with a calibrator
beyond max (issue 23) also has "calibrator": "histogram/entropy" |
"histogram/percentile" | "histogram/mse" | "mse" | "nvfp4_mse" (its amax is
the method's).
`amaxctl export` writes the same file.
"""
import json
import os
import struct
from typing import Any, Dict, List, Mapping, Sequence

import numpy as np

from ._gen import amaxd_pb2 as pb

FORMATS = {1: "fp8_e4m3", 2: "fp8_e5m2", 3: "nvfp4", 4: "mxfp8"}
BLOCK = {3: "e4m3", 4: "e8m0"}


def tensors(results: Mapping[str, Any], formats: Mapping[str, int]) -> Dict[str, np.ndarray]:
    """{tensor name: numpy array} of whole-tensor results (amaxd.Result or
    anything with its attributes), in file order."""
    out: Dict[str, np.ndarray] = {}
    for name in sorted(results):
        r = results[name]
        out[name + ".amax"] = np.asarray(r.amax, dtype="<f4")
        out[name + ".scale"] = np.asarray(r.scale, dtype="<f4")
        out[name + ".scale_inv"] = np.asarray(r.scale_inv, dtype="<f4")
        if formats[name] in BLOCK:
            out[name + ".block_scale"] = np.asarray(r.block_scales, dtype=np.uint8)
        if getattr(r, "global_amaxes", None) is not None:  # per-slice globals
            out[name + ".global_amax"] = np.asarray(r.global_amaxes, dtype="<f4")
            out[name + ".global_scale"] = np.asarray(r.global_scales, dtype="<f4")
            out[name + ".global_scale_inv"] = np.asarray(r.global_scale_invs, dtype="<f4")
            continue
        out[name + ".global_amax"] = np.array(r.global_amax, dtype="<f4")
        out[name + ".global_scale"] = np.array(r.global_scale, dtype="<f4")
        out[name + ".global_scale_inv"] = np.array(r.global_scale_inv, dtype="<f4")
    return out


def write(path: str, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> None:
    """Writes a safetensors file atomically (PATH.tmp, fsync, rename)."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata)}
    off = 0
    for k, a in arrays.items():
        dtype = {np.dtype("<f4"): "F32", np.dtype(np.uint8): "U8"}[a.dtype]
        header[k] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for a in arrays.values():
            f.write(np.ascontiguousarray(a).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def metadata(job: str, epoch: int, infos: Sequence[pb.QuantizerInfo]) -> Dict[str, str]:
    """The file's __metadata__ for the job's quantizers `infos`."""
    qs: List[Dict[str, Any]] = [{"name": q.name, "shape": list(q.global_shape), "format": FORMATS[q.recipe.format],
           "block_scale": BLOCK.get(q.recipe.format, "")} for q in infos]
    for d, q in zip(qs, infos):
        if getattr(q, "global_axes", 0):
            d["global_axes"] = int(q.global_axes)
        cal = q.calibrator if q.HasField("calibrator") else None
        if cal is not None and cal.kind == pb.CALIBRATOR_MSE:
            d["calibrator"] = "mse"
        elif cal is not None and cal.kind == pb.CALIBRATOR_NVFP4_MSE:
            d["calibrator"] = "nvfp4_mse"
        elif cal is not None and cal.kind == pb.CALIBRATOR_HISTOGRAM:
            d["calibrator"] = "histogram/" + {1: "entropy", 2: "percentile", 3: "mse"}.get(
                cal.method, "")
    return {"amaxd.format": "scales/1", "amaxd.job": job, "amaxd.epoch": str(epoch),
            "amaxd.quantizers": json.dumps(qs, separators=(",", ":"))}
