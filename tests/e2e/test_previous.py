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



def test_previous_globals_of_steady_epochs_named_and_packed(daemon):
    """Epochs of one catalog after another, answered while the previous
    globals are read in place from the output set behind the front (the
    host copy is made after the answers): every epoch's previous globals
    are the epoch before's globals, for a named rank and a packed rank of
    the same job, and GetScales between epochs (the host copy) agrees."""
    import threading
    R = amaxd.Recipe
    qs = [amaxd.Quantizer(f"s.{i:02d}", [] if i % 3 else [3], R.fp8_current(),
                          accumulation=amaxd.PER_EPOCH) for i in range(12)]
    rng = np.random.default_rng(7)
    epochs = [{q.name: (rng.random(3, dtype=np.float32) * (e + 1) if q.global_shape
                        else np.float32(rng.random() * (e + 1))) for q in qs} for e in range(6)]
    got_named, got_packed, again, errs = [], [], [], []

    def named_rank():
        with daemon.client("steady", 0, 2) as c:
            c.join()
            c.register(qs)
            for vals in epochs:
                c.send(vals)
                got_named.append(c.reconcile())
                again.append(c.get_scales())

    def packed_rank():
        with daemon.client("steady", 1, 2) as c:
            c.join()
            c.register(qs)
            L = c.layout()
            for vals in epochs:
                c.send_packed(L.pack(vals)[0], None)
                got_packed.append((L.names, c.reconcile_packed()))

    def body(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - raised below
            errs.append(e)
    ts = [threading.Thread(target=body, args=(f,)) for f in (named_rank, packed_rank)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errs:
        raise errs[0]
    assert len(got_named) == len(got_packed) == len(epochs)
    for e, (got, (names, pk)) in enumerate(zip(got_named, got_packed)):
        for i, name in enumerate(names):
            assert got[name].global_amax == pk.global_amax[i], (e, name)
            if e == 0:
                assert got[name].previous_global_amax is None, name
                assert not pk.has_previous[i], name
                continue
            before = got_named[e - 1][name]
            assert got[name].previous_global_amax == before.global_amax, (e, name)
            assert got[name].previous_global_scale == before.global_scale, (e, name)
            assert pk.has_previous[i], (e, name)
            assert pk.previous_global_amax[i] == before.global_amax, (e, name)
            assert pk.previous_global_scale[i] == before.global_scale, (e, name)
        for name in got:
            assert again[e][name].previous_global_amax == got[name].previous_global_amax, name
