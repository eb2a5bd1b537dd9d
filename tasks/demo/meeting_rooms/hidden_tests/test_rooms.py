import random

import pytest

from rooms import assign_rooms, min_rooms


def test_example():
    meetings = [(0, 30), (5, 10), (15, 20)]
    assert assign_rooms(meetings) == [0, 1, 1]
    assert min_rooms(meetings) == 2


def test_back_to_back_reuses_room():
    assert assign_rooms([(1, 2), (2, 3), (3, 4)]) == [0, 0, 0]


def test_lowest_free_room_and_input_order():
    meetings = [(10, 20), (0, 5), (0, 10), (1, 11), (10, 12)]
    # by start: (0,5)->0, (0,10)->1, (1,11)->2, (10,12)->0 (lowest free of 0,1), (10,20)->1
    assert assign_rooms(meetings) == [1, 0, 1, 2, 0]
    assert min_rooms(meetings) == 3


def test_empty_and_invalid():
    assert assign_rooms([]) == []
    assert min_rooms([]) == 0
    with pytest.raises(ValueError):
        assign_rooms([(3, 3)])


def test_no_overlap_within_a_room_and_optimal():
    rng = random.Random(7)
    meetings = []
    for _ in range(2000):
        s = rng.randrange(0, 10_000)
        meetings.append((s, s + rng.randrange(1, 200)))
    rooms = assign_rooms(meetings)
    by_room = {}
    for (s, e), r in zip(meetings, rooms):
        by_room.setdefault(r, []).append((s, e))
    for spans in by_room.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # optimal = the maximum number of meetings running at any instant
    events = sorted([(s, 1) for s, _ in meetings] + [(e, -1) for _, e in meetings], key=lambda x: (x[0], x[1]))
    depth = peak = 0
    for _, d in events:
        depth += d
        peak = max(peak, depth)
    assert min_rooms(meetings) == peak == max(rooms) + 1


def test_large_input():
    meetings = [(i, i + 50) for i in range(100_000)]
    assert min_rooms(meetings) == 50
