from vowels import count_vowels


def test_empty():
    assert count_vowels("") == 0


def test_lowercase():
    assert count_vowels("banana") == 3


def test_mixed_case_and_punctuation():
    assert count_vowels("HELLO, World!") == 3


def test_y_is_not_a_vowel():
    assert count_vowels("rhythm sky") == 0
