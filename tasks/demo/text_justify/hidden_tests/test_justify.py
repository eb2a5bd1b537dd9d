import pytest

from justify import justify


def test_classic_example():
    text = "This is an example of text justification."
    assert justify(text, 16) == [
        "This    is    an",
        "example  of text",
        "justification.  ",
    ]


def test_uneven_gaps_go_left_and_single_word_lines():
    assert justify("What must be acknowledgment shall be", 16) == [
        "What   must   be",
        "acknowledgment  ",
        "shall be        ",
    ]
    assert justify("a b c d e", 6) == ["a  b c", "d e   "]


def test_every_line_has_the_width():
    text = "Science is what we understand well enough to explain to a computer. Art is everything else we do"
    lines = justify(text, 20)
    assert all(len(line) == 20 for line in lines)
    assert " ".join(" ".join(lines).split()) == " ".join(text.split())
    assert lines[-1] == "do".ljust(20)


def test_whitespace_and_empty():
    assert justify("  one\n\ttwo  ", 10) == ["one two   "]
    assert justify("   ", 5) == []


def test_exact_fit():
    assert justify("abc de", 6) == ["abc de"]
    assert justify("abc de fg", 6) == ["abc de", "fg    "]


def test_errors():
    with pytest.raises(ValueError):
        justify("supercalifragilistic", 5)
    with pytest.raises(ValueError):
        justify("a", 0)
