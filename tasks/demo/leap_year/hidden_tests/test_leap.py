from calendar_util import is_leap


def test_ordinary_years():
    assert is_leap(2024)
    assert not is_leap(2023)


def test_centuries():
    assert not is_leap(1900)
    assert not is_leap(2100)


def test_four_hundreds():
    assert is_leap(2000)
    assert is_leap(1600)


def test_against_a_count():
    assert sum(is_leap(y) for y in range(1601, 2001)) == 97
