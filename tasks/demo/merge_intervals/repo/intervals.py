def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    raise NotImplementedError
