import pytest

from calc import evaluate


def test_precedence_and_assoc():
    assert evaluate("2 + 3 * 4") == 14
    assert evaluate("10 - 4 - 3") == 3
    assert evaluate("2 * 3 + 4 * 5") == 26
    assert evaluate("100 / 10 / 5") == 2.0


def test_parentheses_and_unary():
    assert evaluate("(2 + 3) * 4") == 20
    assert evaluate("-(3 - 5) * -2") == -4
    assert evaluate("--3") == 3
    assert evaluate("+4") == 4


def test_types():
    assert isinstance(evaluate("6 * 7"), int)
    assert isinstance(evaluate("6 / 3"), float)
    assert evaluate("1.5 * 4") == 6.0
    assert evaluate(" 7/2 ") == 3.5


def test_nested_whitespace():
    assert evaluate(" ( ( 1 + 2 ) * ( 3 + 4 ) ) / 7 ") == 3.0


@pytest.mark.parametrize("bad", ["", "   ", "1 +", "(1 + 2", "1 + 2)", "2 * * 3", "4 $ 4", "()", "3 4"])
def test_malformed(bad):
    with pytest.raises(ValueError):
        evaluate(bad)


def test_division_by_zero():
    with pytest.raises(ZeroDivisionError):
        evaluate("1 / (2 - 2)")
