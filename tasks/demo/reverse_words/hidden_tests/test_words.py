from words import reverse_words


def test_basic():
    assert reverse_words("the quick brown fox") == "fox brown quick the"


def test_extra_whitespace():
    assert reverse_words("  hello \t  world\n") == "world hello"


def test_single_and_empty():
    assert reverse_words("alone") == "alone"
    assert reverse_words("   ") == ""
