from palindrome import is_palindrome


def test_simple():
    assert is_palindrome("racecar")
    assert not is_palindrome("racecars")


def test_case_insensitive():
    assert is_palindrome("RaceCar")


def test_ignores_punctuation_and_spaces():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert is_palindrome("No 'x' in Nixon")


def test_digits_count():
    assert is_palindrome("1a2-2A1")
    assert not is_palindrome("12 3")
