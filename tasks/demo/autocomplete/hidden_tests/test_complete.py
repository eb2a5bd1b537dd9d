import pytest

from complete import Autocomplete


def make():
    ac = Autocomplete()
    for word, w in [("car", 5), ("card", 3), ("care", 3), ("careful", 8), ("cat", 1), ("dog", 2)]:
        ac.add(word, w)
    return ac


def test_complete_order():
    ac = make()
    assert ac.complete("car") == ["careful", "car", "card", "care"]
    assert ac.complete("ca", k=2) == ["careful", "car"]
    assert ac.complete("") == ["careful", "car", "card", "care", "dog"]


def test_no_match():
    ac = make()
    assert ac.complete("z") == []
    assert ac.complete("carefully") == []


def test_add_accumulates_weight():
    ac = make()
    ac.add("cat", 10)
    assert ac.weight("cat") == 11
    assert ac.complete("ca", k=1) == ["cat"]
    assert len(ac) == 6


def test_remove_keeps_other_words():
    ac = make()
    ac.remove("car")
    assert "car" not in ac and "card" in ac and "careful" in ac
    assert ac.complete("car") == ["careful", "card", "care"]
    ac.remove("careful")
    assert ac.complete("care") == ["care"]
    assert len(ac) == 4
    with pytest.raises(KeyError):
        ac.remove("car")
    with pytest.raises(KeyError):
        ac.remove("ca")  # a prefix, not a word


def test_membership_and_errors():
    ac = make()
    assert "dog" in ac and "do" not in ac and "" not in ac
    with pytest.raises(KeyError):
        ac.weight("do")
    with pytest.raises(ValueError):
        ac.add("")


def test_case_sensitive_and_many_words():
    ac = Autocomplete()
    for i in range(20_000):
        ac.add(f"w{i:05d}", i % 100)
    ac.add("W00001", 1000)
    assert ac.complete("w0000", k=3) == ["w00009", "w00008", "w00007"]
    assert ac.complete("W") == ["W00001"]
    assert len(ac) == 20_001
