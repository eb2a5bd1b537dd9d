from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def chunk(iterable: Iterable[T], size: int) -> Iterator[list[T]]:
    raise NotImplementedError
