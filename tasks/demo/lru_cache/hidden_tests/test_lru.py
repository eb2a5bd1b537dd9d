import pytest

from lru import LRUCache


def test_get_put():
    c = LRUCache(2)
    c.put("a", 1)
    assert c.get("a") == 1
    assert c.get("zz") is None
    assert c.get("zz", 0) == 0


def test_eviction_order():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.get("a")  # b is now least recent
    c.put("c", 3)
    assert "b" not in c
    assert c.keys() == ["a", "c"]


def test_update_refreshes():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    c.put("a", 10)
    c.put("c", 3)
    assert c.keys() == ["a", "c"]
    assert c.get("a") == 10
    assert len(c) == 2


def test_contains_does_not_refresh():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert "a" in c
    c.put("c", 3)
    assert "a" not in c and c.keys() == ["b", "c"]


def test_capacity_one_and_invalid():
    c = LRUCache(1)
    c.put(1, "x")
    c.put(2, "y")
    assert c.keys() == [2]
    with pytest.raises(ValueError):
        LRUCache(0)


def test_many_operations_fast():
    c = LRUCache(1000)
    for i in range(100_000):
        c.put(i, i)
        c.get(i - 500)
    assert len(c) == 1000
