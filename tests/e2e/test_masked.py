"""amaxd.Masked: values with a bool mask of the cells without data (numpy
here; tests/modelopt sends torch masks)."""
import numpy as np
import pytest

import amaxd


def test_masked_numpy_bool(daemon):
    name = "m.experts.input_quantizer"
    with daemon.client("masked-np", 0, 1) as c:
        c.join()
        c.register([amaxd.Quantizer(name, [4], amaxd.Recipe.fp8_current(), peer_group="m.experts"),
                    amaxd.Quantizer("m.scalar", [], amaxd.Recipe.fp8_current())])
        c.send({name: amaxd.Masked(np.array([1, 7, 2, 9], np.float32), np.array([0, 1, 0, 1], bool)),
                "m.scalar": amaxd.Masked(3.0, True)})
        res = c.reconcile()
        # Masked cells are no data: the peer group fills them with its max (2).
        assert res[name].amax.tolist() == [1.0, 2.0, 2.0, 2.0] and res[name].missing == 0
        assert res["m.scalar"].amax.tolist() == 0.0 and res["m.scalar"].missing == 1
        with pytest.raises(TypeError, match="bool"):
            c.send({name: amaxd.Masked(np.ones(4), np.ones(4))})
        with pytest.raises(ValueError, match="mask of shape"):
            c.send({name: amaxd.Masked(np.ones(4), np.ones(3, bool))})
