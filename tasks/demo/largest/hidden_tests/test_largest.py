import pytest

from stats_util import largest


def test_list():
    assert largest([3, 9, -2, 9, 4]) == 9


def test_negatives_and_floats():
    assert largest([-5.5, -1.25, -3.0]) == -1.25


def test_generator():
    assert largest(x * x for x in range(-10, 4)) == 100


def test_empty():
    with pytest.raises(ValueError):
        largest([])
