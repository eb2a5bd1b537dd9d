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


class CountingList(list):
    reads = 0

    def __getitem__(self, i):
        CountingList.reads += 1
        return super().__getitem__(i)


def test_logarithmic():
    items = CountingList(range(1 << 16))
    CountingList.reads = 0
    assert find(items, 12345) == 12345
    assert CountingList.reads <= 40
