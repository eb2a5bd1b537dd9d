from spell import edit_distance, suggest


def test_distance_examples():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("flaw", "lawn") == 2
    assert edit_distance("", "abc") == 3
    assert edit_distance("same", "same") == 0


def test_distance_symmetric():
    pairs = [("abc", "yabd"), ("intention", "execution"), ("a", "")]
    assert all(edit_distance(a, b) == edit_distance(b, a) for a, b in pairs)
    assert edit_distance("intention", "execution") == 5


def test_distance_long_strings():
    a = "ab" * 200
    b = "ba" * 200
    assert edit_distance(a, b) == 2


def test_suggest_order_and_limit():
    vocab = ["hello", "help", "hell", "shell", "yellow", "held", "world"]
    assert suggest("helo", vocab) == ["held", "hell", "hello"]
    assert suggest("helo", vocab, limit=5) == ["held", "hell", "hello", "help", "shell"]


def test_suggest_case_and_duplicates():
    assert suggest("PYTHON", ["Python", "python", "Python", "pythons"], max_distance=1) == [
        "Python", "python", "pythons",
    ]


def test_suggest_nothing_close():
    assert suggest("zzzz", ["alpha", "beta"]) == []
