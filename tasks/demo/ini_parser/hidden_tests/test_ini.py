import pytest

from ini import IniError, parse_ini

SAMPLE = """
; global comment
[server]
Host = example.org
port=8080
  # indented comment
path = /a=b

[ client ]
name = Rollway Bot
"""


def test_sample():
    assert parse_ini(SAMPLE) == {
        "server": {"host": "example.org", "port": "8080", "path": "/a=b"},
        "client": {"name": "Rollway Bot"},
    }


def test_empty_text():
    assert parse_ini("") == {}
    assert parse_ini("\n\n; nothing\n") == {}


def test_repeated_section_merges():
    text = "[a]\nx = 1\ny = 2\n[b]\nz = 3\n[a]\nx = 9\n"
    assert parse_ini(text) == {"a": {"x": "9", "y": "2"}, "b": {"z": "3"}}


def test_empty_value_allowed():
    assert parse_ini("[s]\nk =\n") == {"s": {"k": ""}}


@pytest.mark.parametrize(
    "text, line",
    [
        ("k = v\n[s]\n", 1),
        ("[s]\n\njust words\n", 3),
        ("[s]\n = v\n", 2),
        ("[s]\nok = 1\n[ ]\n", 3),
    ],
)
def test_errors_name_the_line(text, line):
    with pytest.raises(IniError) as info:
        parse_ini(text)
    assert info.value.line == line
    assert isinstance(info.value, ValueError)
