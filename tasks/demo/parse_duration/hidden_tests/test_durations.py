import pytest

from durations import parse_duration


def test_single_units():
    assert parse_duration("45s") == 45
    assert parse_duration("2m") == 120
    assert parse_duration("3h") == 10800
    assert parse_duration("2d") == 172800


def test_combined():
    assert parse_duration("1h30m") == 5400
    assert parse_duration("1h5s") == 3605
    assert parse_duration("1d2h3m4s") == 93784


def test_whitespace_and_zero():
    assert parse_duration("  10m ") == 600
    assert parse_duration("0s") == 0


@pytest.mark.parametrize("text", ["", "   ", "10", "5x", "1m1h", "1h1h", "h", "1.5h", "1h 30m", "-5s"])
def test_invalid(text):
    with pytest.raises(ValueError):
        parse_duration(text)
