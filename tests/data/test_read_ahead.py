"""The prompt stream's lead over the rollout stage, as the driver counts it."""

import pytest

from areal_ray.data.read_ahead import ReadAhead


def test_ahead_is_read_minus_taken():
    r = ReadAhead()
    r.read(256)
    r.took(1)
    r.took(1)
    assert (r.n_read, r.n_taken, r.ahead) == (256, 2, 254)


@pytest.mark.parametrize("waiting, wakes", [(True, True), (False, False)])
def test_a_take_wakes_a_waiting_reader_once(waiting, wakes):
    r = ReadAhead(waiting=waiting)
    assert r.took(1) is wakes
    assert r.took(1) is False  # until the reader waits again


def test_a_negative_read_is_refused():
    with pytest.raises(ValueError, match="negative"):
        ReadAhead().read(-1)
