import pytest

from rx import fullmatch


@pytest.mark.parametrize(
    "pattern, text, expected",
    [
        ("abc", "abc", True),
        ("abc", "abcd", False),
        ("a.c", "axc", True),
        ("a.c", "ac", False),
        ("", "", True),
        ("", "a", False),
    ],
)
def test_literals_and_dot(pattern, text, expected):
    assert fullmatch(pattern, text) is expected


def test_quantifiers():
    assert fullmatch("ab*c", "ac") and fullmatch("ab*c", "abbbc")
    assert not fullmatch("ab+c", "ac") and fullmatch("ab+c", "abbc")
    assert fullmatch("colou?r", "color") and fullmatch("colou?r", "colour")
    assert not fullmatch("colou?r", "colouur")
    assert fullmatch(".*", "anything at all") and fullmatch(".*", "")


def test_groups_and_alternation():
    assert fullmatch("(ab)+", "ababab")
    assert not fullmatch("(ab)+", "aba")
    assert fullmatch("cat|dog", "dog")
    assert not fullmatch("cat|dog", "catdog")
    assert fullmatch("gr(a|e)y", "grey") and not fullmatch("gr(a|e)y", "groy")
    assert fullmatch("(a|b)*c(d|)", "ababc") and fullmatch("(a|b)*c(d|)", "cd")


def test_escapes():
    assert fullmatch(r"a\.b", "a.b") and not fullmatch(r"a\.b", "axb")
    assert fullmatch(r"\*+", "***")
    assert fullmatch(r"\(\)", "()")
    assert fullmatch(r"\\", "\\")


@pytest.mark.parametrize("bad", ["*a", "a(*b)", "a|+", "abc\\", "(ab", "ab)", "a**(", "((a)"])
def test_invalid_patterns(bad):
    with pytest.raises(ValueError):
        fullmatch(bad, "a")


def test_no_exponential_blowup():
    assert not fullmatch("(a*)*b", "a" * 30)
    assert fullmatch("(a|aa)*c", "a" * 40 + "c")
    # the classic pathological case for backtracking matchers: a?^n a^n against a^n
    assert fullmatch("a?" * 30 + "a" * 30, "a" * 30)
    assert not fullmatch("a?" * 30 + "a" * 30, "a" * 29)
