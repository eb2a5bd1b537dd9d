import pytest

from ratelimit import TokenBucket


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_starts_full_and_drains():
    clock = FakeClock()
    b = TokenBucket(rate=1, capacity=3, clock=clock)
    assert [b.allow() for _ in range(4)] == [True, True, True, False]


def test_refills_over_time_capped():
    clock = FakeClock()
    b = TokenBucket(rate=2, capacity=4, clock=clock)
    for _ in range(4):
        b.allow()
    clock.now += 0.5
    assert b.tokens == pytest.approx(1.0)
    clock.now += 100
    assert b.tokens == pytest.approx(4.0)


def test_failed_allow_takes_nothing():
    clock = FakeClock()
    b = TokenBucket(rate=1, capacity=5, clock=clock)
    assert b.allow(4)
    assert not b.allow(2)
    assert b.tokens == pytest.approx(1.0)
    clock.now += 1
    assert b.allow(2)


def test_fractional_rate():
    clock = FakeClock()
    b = TokenBucket(rate=0.5, capacity=1, clock=clock)
    assert b.allow()
    clock.now += 1.9
    assert not b.allow()
    clock.now += 0.1
    assert b.allow()


@pytest.mark.parametrize("kwargs", [dict(rate=0, capacity=1), dict(rate=1, capacity=0), dict(rate=-1, capacity=5)])
def test_bad_construction(kwargs):
    with pytest.raises(ValueError):
        TokenBucket(clock=FakeClock(), **kwargs)


def test_bad_cost():
    b = TokenBucket(rate=1, capacity=2, clock=FakeClock())
    for cost in (0, -1, 3):
        with pytest.raises(ValueError):
            b.allow(cost)
