from greeting import greet


def test_plain():
    assert greet("Ada") == "Hello, Ada!"


def test_strips_whitespace():
    assert greet("  Grace \n") == "Hello, Grace!"


def test_empty():
    assert greet("") == "Hello, stranger!"


def test_blank():
    assert greet("   ") == "Hello, stranger!"
