import pytest

from roman import from_roman, to_roman


def test_to_roman_examples():
    assert to_roman(1) == "I"
    assert to_roman(4) == "IV"
    assert to_roman(1994) == "MCMXCIV"
    assert to_roman(3999) == "MMMCMXCIX"


def test_from_roman_examples():
    assert from_roman("XLII") == 42
    assert from_roman("MMXXIV") == 2024


def test_round_trip_all():
    assert all(from_roman(to_roman(n)) == n for n in range(1, 4000))


@pytest.mark.parametrize("n", [0, -1, 4000])
def test_to_roman_range(n):
    with pytest.raises(ValueError):
        to_roman(n)


@pytest.mark.parametrize("s", ["", "IIII", "IC", "VV", "ABC", "MMMM"])
def test_from_roman_rejects(s):
    with pytest.raises(ValueError):
        from_roman(s)
