import pytest

from factorial import factorial


def test_small():
    assert [factorial(n) for n in range(6)] == [1, 1, 2, 6, 24, 120]


def test_twenty():
    assert factorial(20) == 2432902008176640000


def test_negative():
    with pytest.raises(ValueError):
        factorial(-1)
