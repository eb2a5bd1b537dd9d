from typing import Iterable


def largest(values: Iterable[float]) -> float:
    raise NotImplementedError
