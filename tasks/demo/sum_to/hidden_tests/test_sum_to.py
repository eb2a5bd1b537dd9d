from mathutil import sum_to


def test_one():
    assert sum_to(1) == 1


def test_ten():
    assert sum_to(10) == 55


def test_large():
    assert sum_to(100_000) == 5_000_050_000


def test_zero_and_negative():
    assert sum_to(0) == 0
    assert sum_to(-7) == 0
