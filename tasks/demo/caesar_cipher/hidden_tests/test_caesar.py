from caesar import decrypt, encrypt


def test_basic():
    assert encrypt("abc", 1) == "bcd"
    assert encrypt("xyz", 3) == "abc"


def test_case_and_punctuation():
    assert encrypt("Hello, World! 42", 5) == "Mjqqt, Btwqi! 42"


def test_large_and_negative_shifts():
    assert encrypt("abc", 27) == "bcd"
    assert encrypt("abc", -1) == "zab"


def test_non_ascii_unchanged():
    assert encrypt("café ñ", 1) == "dbgé ñ"


def test_round_trip():
    text = "The Quick Brown Fox jumps over 13 lazy dogs."
    for shift in (-30, -1, 0, 7, 52, 100):
        assert decrypt(encrypt(text, shift), shift) == text
