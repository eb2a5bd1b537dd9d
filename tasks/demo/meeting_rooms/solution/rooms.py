import heapq


def assign_rooms(meetings: list[tuple[int, int]]) -> list[int]:
    for start, end in meetings:
        if start >= end:
            raise ValueError(f"meeting ({start}, {end}) does not end after it starts")
    order = sorted(range(len(meetings)), key=lambda i: (meetings[i][0], meetings[i][1], i))
    busy: list[tuple[int, int]] = []  # (end, room)
    free: list[int] = []
    rooms_used = 0
    assigned = [0] * len(meetings)
    for i in order:
        start, end = meetings[i]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            room = heapq.heappop(free)
        else:
            room = rooms_used
            rooms_used += 1
        assigned[i] = room
        heapq.heappush(busy, (end, room))
    return assigned


def min_rooms(meetings: list[tuple[int, int]]) -> int:
    return max(assign_rooms(meetings), default=-1) + 1
