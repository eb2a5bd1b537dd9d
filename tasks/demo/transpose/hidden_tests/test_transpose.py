import pytest

from matrix_util import transpose


def test_square():
    assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]


def test_rectangular():
    assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]


def test_empty_and_single():
    assert transpose([]) == []
    assert transpose([[7]]) == [[7]]


def test_input_untouched_and_new_lists():
    m = [[1, 2], [3, 4]]
    t = transpose(m)
    t[0][0] = 99
    assert m == [[1, 2], [3, 4]]


def test_ragged():
    with pytest.raises(ValueError):
        transpose([[1, 2], [3]])
