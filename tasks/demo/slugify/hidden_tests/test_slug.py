from slug import slugify


def test_basic():
    assert slugify("Hello, World!") == "hello-world"


def test_runs_and_edges():
    assert slugify("  --Rust & Python: 2024 edition--  ") == "rust-python-2024-edition"


def test_accents():
    assert slugify("Crème Brûlée à la Café") == "creme-brulee-a-la-cafe"


def test_max_length_no_trailing_dash():
    assert slugify("one two three", max_length=8) == "one-two"
    assert slugify("one two three", max_length=7) == "one-two"
    assert slugify("abc", max_length=10) == "abc"


def test_nothing_left():
    assert slugify("!!!") == ""
