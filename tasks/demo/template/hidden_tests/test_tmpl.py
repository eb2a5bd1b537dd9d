import pytest

from tmpl import render


class User:
    def __init__(self, name):
        self.name = name


def test_simple_substitution():
    assert render("Hello, {{ name }}!", {"name": "Ada"}) == "Hello, Ada!"
    assert render("{{a}}+{{ b }}={{c}}", {"a": 1, "b": 2, "c": 3}) == "1+2=3"


def test_dotted_dicts_and_attributes():
    ctx = {"user": User("grace"), "site": {"meta": {"title": "Rollway"}}}
    assert render("{{ user.name }} @ {{ site.meta.title }}", ctx) == "grace @ Rollway"


def test_filters_chain():
    assert render("{{ x | strip | upper }}", {"x": "  hi  "}) == "HI"
    assert render("{{ x|title }}", {"x": "the end"}) == "The End"
    assert render("{{ x | lower }}", {"x": "LoUd"}) == "loud"


def test_unknown_filter():
    with pytest.raises(ValueError, match="shout"):
        render("{{ x | shout }}", {"x": "a"})


def test_missing_name():
    with pytest.raises(KeyError, match="user.email"):
        render("{{ user.email }}", {"user": {"name": "a"}})


def test_escapes_and_unclosed():
    assert render("{{{{ literal }}}} {{ v }}", {"v": 1}) == "{{ literal }} 1"
    with pytest.raises(ValueError):
        render("oops {{ name", {"name": "x"})


def test_no_placeholders():
    assert render("plain { text }", {}) == "plain { text }"
