import pytest

from intervals import merge


def test_empty():
    assert merge([]) == []


def test_overlapping_unsorted():
    assert merge([(8, 10), (1, 3), (2, 6), (15, 18)]) == [(1, 6), (8, 10), (15, 18)]


def test_touching_and_contained():
    assert merge([(1, 4), (4, 5), (2, 3)]) == [(1, 5)]


def test_disjoint():
    assert merge([(5, 6), (1, 2)]) == [(1, 2), (5, 6)]


def test_bad_interval():
    with pytest.raises(ValueError):
        merge([(3, 1)])
