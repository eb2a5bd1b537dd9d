def assign_rooms(meetings: list[tuple[int, int]]) -> list[int]:
    raise NotImplementedError


def min_rooms(meetings: list[tuple[int, int]]) -> int:
    raise NotImplementedError
