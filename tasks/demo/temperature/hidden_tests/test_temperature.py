import math

from temperature import to_celsius, to_fahrenheit


def test_freezing_and_boiling():
    assert to_fahrenheit(0) == 32
    assert to_fahrenheit(100) == 212


def test_minus_forty_is_the_same():
    assert to_fahrenheit(-40) == -40


def test_round_trip():
    for c in (-273.15, -10.5, 0.0, 36.6, 1000.0):
        assert math.isclose(to_celsius(to_fahrenheit(c)), c, abs_tol=1e-9)


def test_to_celsius_unchanged():
    assert to_celsius(212) == 100
    assert to_celsius(32) == 0
