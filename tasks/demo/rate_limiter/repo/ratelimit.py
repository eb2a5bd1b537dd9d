import time


class TokenBucket:
    def __init__(self, rate: float, capacity: float, clock=time.monotonic) -> None:
        raise NotImplementedError

    @property
    def tokens(self) -> float:
        raise NotImplementedError

    def allow(self, cost: float = 1) -> bool:
        raise NotImplementedError
