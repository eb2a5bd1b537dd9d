import pytest

from numbers_util import clamp


def test_inside():
    assert clamp(5, 0, 10) == 5


def test_below_and_above():
    assert clamp(-3, 0, 10) == 0
    assert clamp(11.5, 0, 10) == 10


def test_bounds_equal():
    assert clamp(7, 3, 3) == 3


def test_bad_bounds():
    with pytest.raises(ValueError):
        clamp(1, 5, 2)
