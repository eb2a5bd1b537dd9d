from collections.abc import Sequence

from search import find


def test_every_element_found():
    items = list(range(0, 40, 2))
    assert [find(items, x) for x in items] == list(range(len(items)))


def test_absent():
    items = [1, 3, 5, 7]
    assert [find(items, x) for x in (0, 2, 4, 8)] == [-1, -1, -1, -1]
    assert find([], 3) == -1


def test_single_element():
    assert find([5], 5) == 0


def test_first_of_duplicates():
    items = [1, 2, 2, 2, 2, 2, 3, 9, 9]
    assert find(items, 2) == 1
    assert find(items, 9) == 7


class CountingSequence(Sequence):
    """Counts every element read: by index, by slice, and through iteration, copies,
    `in` and `index` (the Sequence mixins read through __getitem__), so no C-level list
    method can read it for free."""

    def __init__(self, items):
        self._items = list(items)
        self.reads = 0

    def __len__(self):
        return len(self._items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            self.reads += len(range(*i.indices(len(self._items))))
        else:
            self.reads += 1
        return self._items[i]


def test_logarithmic():
    items = CountingSequence(range(1 << 16))
    assert find(items, 12345) == 12345
    assert find(items, 70000) == -1
    assert items.reads <= 80
