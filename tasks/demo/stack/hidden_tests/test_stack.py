import pytest

from stack import Stack


def test_push_pop_lifo():
    s = Stack()
    for x in (1, 2, 3):
        s.push(x)
    assert [s.pop(), s.pop(), s.pop()] == [3, 2, 1]


def test_peek_and_len():
    s = Stack("ab")
    assert s.peek() == "b"
    assert len(s) == 2
    assert not s.is_empty()


def test_empty_errors():
    s = Stack()
    assert s.is_empty() and len(s) == 0
    with pytest.raises(IndexError, match="empty stack"):
        s.pop()
    with pytest.raises(IndexError, match="empty stack"):
        s.peek()


def test_iteration_top_to_bottom():
    s = Stack([1, 2, 3])
    assert list(s) == [3, 2, 1]
    assert len(s) == 3
