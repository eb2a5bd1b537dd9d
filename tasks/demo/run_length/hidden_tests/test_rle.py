import pytest

from rle import decode, encode


def test_encode():
    assert encode("aaabcc") == "3a1b2c"
    assert encode("") == ""


def test_multi_digit_counts():
    assert encode("x" * 12 + "y") == "12x1y"
    assert decode("12x1y") == "x" * 12 + "y"


def test_round_trip_with_spaces_and_symbols():
    text = "  !!!?? \n\nabba"
    assert decode(encode(text)) == text


@pytest.mark.parametrize("bad", ["a", "3", "3a2", "0a", "a3"])
def test_decode_rejects(bad):
    with pytest.raises(ValueError):
        decode(bad)
