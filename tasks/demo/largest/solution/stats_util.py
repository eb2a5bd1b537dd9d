from typing import Iterable


def largest(values: Iterable[float]) -> float:
    it = iter(values)
    try:
        best = next(it)
    except StopIteration:
        raise ValueError("largest() of an empty iterable") from None
    for v in it:
        if v > best:
            best = v
    return best
