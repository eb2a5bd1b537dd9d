from dedupe import unique


def test_keeps_first_occurrence_order():
    assert unique([3, 1, 3, 2, 1, 5]) == [3, 1, 2, 5]


def test_strings():
    assert unique("mississippi") == ["m", "i", "s", "p"]


def test_key_function():
    assert unique(["Apple", "apple", "Banana", "APPLE", "banana"], key=str.lower) == ["Apple", "Banana"]


def test_unhashable_items_with_key():
    rows = [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}, {"id": 1, "v": "c"}]
    assert unique(rows, key=lambda r: r["id"]) == [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}]
