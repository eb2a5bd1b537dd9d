from nested import flatten


def test_flat_stays_flat():
    assert flatten([1, 2, 3]) == [1, 2, 3]


def test_one_level():
    assert flatten([1, [2, 3], 4]) == [1, 2, 3, 4]


def test_deep():
    assert flatten([1, [2, [3, [4, [5]]]], [[6]]]) == [1, 2, 3, 4, 5, 6]


def test_keeps_strings_and_tuples():
    assert flatten(["ab", [("c", "d"), ["e"]], []]) == ["ab", ("c", "d"), "e"]


def test_very_deep():
    deep = [0]
    for i in range(1, 5000):
        deep = [deep, i]
    assert flatten(deep) == list(range(5000))
