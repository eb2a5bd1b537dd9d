import itertools

import pytest

from chunks import chunk


def test_even():
    assert list(chunk([1, 2, 3, 4], 2)) == [[1, 2], [3, 4]]


def test_uneven():
    assert list(chunk("abcde", 2)) == [["a", "b"], ["c", "d"], ["e"]]


def test_empty():
    assert list(chunk([], 3)) == []


def test_infinite_is_lazy():
    first = list(itertools.islice(chunk(itertools.count(), 3), 2))
    assert first == [[0, 1, 2], [3, 4, 5]]


def test_bad_size():
    with pytest.raises(ValueError):
        list(chunk([1, 2], 0))
