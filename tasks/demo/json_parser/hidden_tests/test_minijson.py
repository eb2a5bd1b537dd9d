import json

import pytest

from minijson import JSONError, loads


def test_scalars():
    assert loads("true") is True and loads("false") is False and loads("null") is None
    assert loads("0") == 0 and isinstance(loads("-12"), int)
    assert loads("3.25") == 3.25 and loads("1e3") == 1000.0 and isinstance(loads("1E+2"), float)
    assert loads(' "hi" ') == "hi"


def test_nested_document():
    text = '{"a": [1, 2, {"b": null}], "c": {"d": [true, false]}, "e": -0.5e-1, "f": []}'
    assert loads(text) == json.loads(text)


def test_whitespace_and_empty_containers():
    assert loads(" \t\n\r{ } ") == {}
    assert loads("[ ]") == []
    assert loads('[\n 1 ,\n 2 \n]') == [1, 2]


def test_string_escapes():
    assert loads(r'"a\"b\\c\/d\b\f\n\r\t"') == 'a"b\\c/d\b\f\n\r\t'
    assert loads(r'"\u00e9\u4e2d"') == "é中"
    assert loads(r'"\ud83d\ude00"') == "\U0001F600"


def test_duplicate_keys_last_wins():
    assert loads('{"k": 1, "k": 2}') == {"k": 2}


@pytest.mark.parametrize(
    "text, pos",
    [
        ("", 0),
        ("[1, 2", 5),
        ("[1,]", 3),
        ('{"a" 1}', 5),
        ("01", 1),
        ("+1", 0),
        ("1.", 2),
        ("1.e5", 2),
        ("-", 1),
        ("1e+", 3),
        ("NaN", 0),
        ('"abc', 4),
        ('"a\nb"', 2),
        (r'"\x"', 2),
        ("[1] x", 4),
        ("{1: 2}", 1),
        ("tru", 3),
        ("nulx", 3),
    ],
)
def test_errors_with_position(text, pos):
    with pytest.raises(JSONError) as info:
        loads(text)
    assert info.value.pos == pos
    assert isinstance(info.value, ValueError)


def test_deep_but_reasonable_nesting():
    depth = 200
    text = "[" * depth + "1" + "]" * depth
    value = loads(text)
    for _ in range(depth):
        value = value[0]
    assert value == 1
