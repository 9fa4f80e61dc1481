"""Re-derives every hand-written conformance vector (tests/vectors/recipes.tsv)
with the independent numpy reference, so that a wrong hand derivation and a
wrong implementation would have to agree by accident to pass."""
import os
import struct

import numpy as np
import pytest

import reference as ref

VEC = os.environ.get("AMAXD_VECTORS", os.path.join(os.path.dirname(__file__), "..", "vectors"))


def rows():
    with open(os.path.join(VEC, "recipes.tsv")) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            kind, x, p, want, why = line.rstrip("\n").split("\t")
            yield kind, int(x, 16), int(p, 16), int(want, 16), why


def f(u):
    return np.float32(struct.unpack("<f", struct.pack("<I", u))[0])


def bits(v):
    return int(np.asarray(v, dtype=np.float32).view(np.uint32))


EVAL = {
    "e4m3": lambda x, p: int(ref.e4m3_bits(x)),
    "e8m0": lambda x, p: int(ref.e8m0(x)),
    "fp8_current": lambda x, p: bits(ref.fp8_current(x, 448.0, False, p)),
    "fp8_current_pow2": lambda x, p: bits(ref.fp8_current(x, 448.0, True, p)),
    "fp8_current_e5m2": lambda x, p: bits(ref.fp8_current(x, 57344.0, False, p)),
    "fp8_block_bf16": lambda x, p: bits(ref.fp8_current(x, 448.0, False, p, "bfloat16")),
    "fp8_block_bf16_pow2": lambda x, p: bits(ref.fp8_current(x, 448.0, True, p, "bfloat16")),
    "fp8_block_fp16": lambda x, p: bits(ref.fp8_current(x, 448.0, False, p, "float16")),
    "fp8_block_fp16_pow2": lambda x, p: bits(ref.fp8_current(x, 448.0, True, p, "float16")),
    "fp8_block_fp16_e5m2": lambda x, p: bits(ref.fp8_current(x, 57344.0, False, p, "float16")),
    "nvfp4_global_partial_cast": lambda x, p: bits(ref.nvfp4_global_partial_cast(x)),
    "nvfp4_partial_cast": lambda x, p: int(ref.nvfp4_partial_cast(x, p)),
    "nvfp4_enc_partial_cast": lambda x, p: bits(ref.nvfp4_partial_cast_encode(
        ref.nvfp4_partial_cast(x, p), ref.nvfp4_global_partial_cast(p))),
    "fp8_delayed": lambda x, p: bits(ref.fp8_delayed(x, p)),
    "fp8_delayed_margin1": lambda x, p: bits(ref.fp8_delayed(x, p, margin=1.0)),
    "nvfp4_global": lambda x, p: bits(ref.nvfp4_global(x)),
    "nvfp4_te": lambda x, p: int(ref.nvfp4_te(x, p)),
    "nvfp4_modelopt": lambda x, p: int(ref.nvfp4_modelopt(x, p)),
    "nvfp4_te_legacy": lambda x, p: int(ref.nvfp4_te_legacy(x, p)),
    "nvfp4_modelopt_static": lambda x, p: int(ref.nvfp4_modelopt_static(x, p)),
    "nvfp4_gsi_te": lambda x, p: bits(ref.nvfp4_global_inv(x, "te")),
    "nvfp4_gsi_modelopt": lambda x, p: bits(ref.nvfp4_global_inv(x, "modelopt")),
    "fp8_inv_modelopt": lambda x, p: bits(ref.fp8_inv_modelopt(x)),
    "e8m0_enc_te": lambda x, p: bits(ref.e8m0_encode(bits(x), "te")),
    "e8m0_dec_te": lambda x, p: bits(ref.e8m0_decode(bits(x), "te")),
    "e8m0_enc_ocp": lambda x, p: bits(ref.e8m0_encode(bits(x), "ocp")),
    "e8m0_dec_ocp": lambda x, p: bits(ref.e8m0_decode(bits(x), "ocp")),
    "e8m0_enc_te_legacy": lambda x, p: bits(ref.e8m0_encode(bits(x), "te_legacy")),
    "e8m0_dec_te_legacy": lambda x, p: bits(ref.e8m0_decode(bits(x), "te_legacy")),
    "e8m0_enc_te_2_18": lambda x, p: bits(ref.e8m0_encode(bits(x), "te_2_18")),
    "e8m0_dec_te_2_18": lambda x, p: bits(ref.e8m0_decode(bits(x), "te_2_18")),
    "e8m0_enc_modelopt": lambda x, p: bits(ref.e8m0_encode(bits(x), "modelopt")),
    "e8m0_dec_modelopt": lambda x, p: bits(ref.e8m0_decode(bits(x), "modelopt")),
    "mxfp8": lambda x, p: int(ref.mxfp8(x)),
    "mxfp8_modelopt": lambda x, p: int(ref.mxfp8_modelopt(x)),
}


@pytest.mark.parametrize("kind,x,p,want,why", list(rows()))
def test_vector_matches_reference(kind, x, p, want, why):
    with np.errstate(all="ignore"):
        got = EVAL[kind](f(x), f(p))
    assert got == want, f"{kind}({x:#x}, {p:#x}): reference gives {got:#x}, file says {want:#x} ({why})"
