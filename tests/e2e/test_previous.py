"""Previous-epoch globals (has_previous, previous_global_amax/scale): kept
in catalog order, they must follow each quantizer when a later Register
moves it to another catalog index, and a quantizer new in an epoch has
none."""
import numpy as np

import amaxd

JOB = "prev"


def test_previous_globals_follow_a_reordered_catalog(daemon):
    R = amaxd.Recipe
    # Each epoch's own maxima (not the running max), so that consecutive
    # epochs differ.
    with daemon.client(JOB, 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer("m.b", [], R.fp8_current(), accumulation=amaxd.PER_EPOCH),
                    amaxd.Quantizer("m.d", [4], R.fp8_current(), accumulation=amaxd.PER_EPOCH)])
        c.send({"m.b": 2.0, "m.d": np.array([1, 2, 3, 4], np.float32)})
        c.reconcile()
        c.send({"m.b": 8.0, "m.d": np.array([1, 2, 3, 5], np.float32)})
        got2 = c.reconcile()
        # Names that sort before both: every old quantizer moves to a new
        # catalog index in the epoch that adopts them.
        c.register([amaxd.Quantizer("m.a", [], R.fp8_current(), accumulation=amaxd.PER_EPOCH),
                    amaxd.Quantizer("m.c", [], R.fp8_current(), accumulation=amaxd.PER_EPOCH)])
        c.send({"m.a": 1.0, "m.b": 3.0, "m.c": 4.0,
                "m.d": np.array([1, 1, 1, 1], np.float32)})
        got3 = c.reconcile()
        assert got3["m.b"].global_amax == np.float32(3.0)
        for n in ("m.b", "m.d"):
            assert got3[n].previous_global_amax == got2[n].global_amax, n
            assert got3[n].previous_global_scale == got2[n].global_scale, n
        for n in ("m.a", "m.c"):
            assert got3[n].previous_global_amax is None, n
        # One more epoch: everyone has the one before, in the new order.
        c.send({"m.a": 5.0, "m.b": 6.0, "m.c": 7.0,
                "m.d": np.array([9, 1, 1, 1], np.float32)})
        got4 = c.reconcile()
        for n in ("m.a", "m.b", "m.c", "m.d"):
            assert got4[n].previous_global_amax == got3[n].global_amax, n
            assert got4[n].previous_global_scale == got3[n].global_scale, n
        # GetScales reads the same.
        again = c.get_scales()
        for n in got4:
            assert again[n].previous_global_amax == got4[n].previous_global_amax, n
