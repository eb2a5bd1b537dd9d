from itertools import islice
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def chunk(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    return _chunks(iter(iterable), size)


def _chunks(it: Iterator[T], size: int) -> Iterator[list[T]]:
    while True:
        block = list(islice(it, size))
        if not block:
            return
        yield block
