"""User consumers without a broker: typed handlers, hooks, batches, the error policy and
windows, through bus.testing.ConsumerHarness (the harness users test their own with)."""

from __future__ import annotations

import io

import pytest

from bus.analytics import Analytics, ConsumerError, ConsumerFailed, ErrorPolicy, InvalidEvent, Retryable, consumer
from bus.testing import ConsumerHarness
from bus.windows import RollingWindow, TumblingWindows
from schemas import Cost, Metrics, Reward, Task, TrajectoryChunk


def reward(i: int, value: float = 1.0, version: int = 1) -> Reward:
    return Reward(trajectory_id=f"t{i}", task_id="task", group_id="g", sample_index=i, attempt="a", score=value,
                  reward=value, cost=Cost(generated_tokens=10), weight_version=version)


async def test_readme_example_is_tested_without_a_broker(capsys):
    from bus.examples import mean_reward as example

    example.totals.clear()
    async with ConsumerHarness(example.mean_reward) as h:
        for i, (value, version) in enumerate([(1.0, 1), (0.0, 1), (0.5, 2)]):
            await h.send(reward(i, value, version))
    # on_stop printed the report once the harness stopped.
    assert capsys.readouterr().out == ("version 1: mean reward 0.500 over 2 rewards\n"
                                       "version 2: mean reward 0.500 over 1 rewards\n")
    # Regression: the decorated function stays the function (it was an uncallable object).
    example.totals.clear()
    await example.mean_reward(reward(9, 0.25, 3), None)
    assert dict(example.totals) == {3: [0.25, 1]}


async def test_annotation_selects_the_event_type_and_skips_others():
    seen = []

    @consumer("rewards", "trajectories")
    async def either(event: Reward | TrajectoryChunk, env):
        seen.append(type(event).__name__)

    @consumer("rewards")
    async def only_rewards(r: Reward):  # one parameter: no envelope
        seen.append(r.trajectory_id)

    async with ConsumerHarness(either, only_rewards) as h:
        await h.send(reward(1))
        # A record of another type on the rewards topic: skipped (acked), not handed over.
        await h.send(Metrics(source="x", step=0, values={}), topic="rewards")
    assert seen == ["Reward", "t1"]
    assert h.stats(only_rewards).ignored == 1 and h.stats(only_rewards).handled == 1
    assert [e.offset for e in h.acked["only_rewards"]] == [0, 1]


def test_declaration_errors_are_clear():
    # Regression: @consumer("rewardz") died with a KeyError traceback from deep inside the bus.
    with pytest.raises(ConsumerError, match=r"unknown topic 'rewardz' \(did you mean 'rewards'\?\)"):
        @consumer("rewardz")
        async def typo(r: Reward, env): ...
    with pytest.raises(ConsumerError, match="takes Task, but topic 'rewards' carries Reward"):
        @consumer("rewards")
        async def wrong(t: Task, env): ...
    with pytest.raises(ConsumerError, match="is not an event type"):
        @consumer("rewards")
        async def not_an_event(x: int, env): ...
    with pytest.raises(ConsumerError, match="annotate its first parameter list"):
        @consumer("rewards", batch_size=10)
        async def batch(r: Reward, env): ...
    with pytest.raises(TypeError, match="async"):
        consumer("rewards")(lambda e, env: None)

    class Misspelt(Analytics):
        topics = ["reward"]

        async def handle(self, r: Reward, env): ...

    with pytest.raises(ConsumerError, match=r"Misspelt: unknown topic 'reward' \(did you mean 'rewards'\?\)"):
        ConsumerHarness(Misspelt())
    with pytest.raises(ConsumerError, match="topic"):
        consumer()


async def test_a_bug_in_a_handler_stops_the_consumer_with_a_clear_error():
    @consumer("rewards")
    async def buggy(r: Reward, env):
        if r.sample_index == 1:
            r.weight_versoin  # the typo from the issue  # noqa: B018

    h = ConsumerHarness(buggy)
    await h.send(reward(0))
    with pytest.raises(ConsumerFailed) as failed:
        await h.send(reward(1))
    message = str(failed.value)
    assert message.startswith("consumer buggy stopped at rollway.rewards:0@1 (Reward): AttributeError:")
    assert "weight_versoin" in message and isinstance(failed.value.__cause__, AttributeError)
    assert [e.offset for e in h.acked["buggy"]] == [0]  # never acked: not committed past
    assert h.dead_letters == [] and h.backoffs == []  # not retried, not dead-lettered


async def test_transient_errors_are_retried_with_backoff():
    failures = {"left": 2}

    @consumer("rewards", policy=ErrorPolicy(max_attempts=3, backoff_s=0.5))
    async def flaky(r: Reward, env):
        if failures["left"]:
            failures["left"] -= 1
            raise Retryable("database busy")

    async with ConsumerHarness(flaky) as h:
        await h.send(reward(0))
    assert h.backoffs == [0.5, 1.0] and h.stats(flaky).retries == 2 and h.stats(flaky).handled == 1

    @consumer("rewards", policy=ErrorPolicy(max_attempts=2, backoff_s=0.1))
    async def down(r: Reward, env):
        raise ConnectionError("refused")

    h = ConsumerHarness(down)
    with pytest.raises(ConsumerFailed, match="ConnectionError: refused - still failing after 2 attempts"):
        await h.send(reward(0))
    assert h.acked["down"] == []


async def test_dead_lettering_is_opt_in():
    async def poison(r: Reward, env):
        if r.sample_index == 1:
            raise InvalidEvent("inconsistent")
        if r.sample_index == 2:
            raise TimeoutError("slow")

    skipping = consumer("rewards")(poison)
    async with ConsumerHarness(skipping) as h:
        await h.send(reward(0))
        await h.send(reward(1))
        await h.send_undecodable("rewards")
    assert h.dead_letters == [] and h.stats(skipping).invalid == 1 and h.stats(skipping).undecodable == 1
    assert [e.offset for e in h.acked["poison"]] == [0, 1]

    dead_lettering = consumer("rewards", policy=ErrorPolicy(dead_letter=True, max_attempts=2))(poison)
    async with ConsumerHarness(dead_lettering) as h:
        for i in range(4):
            await h.send(reward(i))
        await h.send_undecodable("rewards")
    assert [(env.offset, kind) for env, _, kind in h.dead_letters] == [(1, "invalid"), (2, "handler")]
    stats = h.stats(dead_lettering)
    assert (stats.handled, stats.dead_lettered, stats.undecodable, stats.retries) == (2, 2, 1, 1)


async def test_function_consumer_hooks_and_batches():
    calls = []

    @consumer("rewards", batch_size=3)
    async def batched(rewards: list[Reward], envs):
        calls.append([r.sample_index for r in rewards])
        assert [e.event for e in envs] == rewards

    @batched.on_start
    def started():
        calls.append("start")

    @batched.on_caught_up
    async def caught_up():
        calls.append("caught up")

    @batched.on_stop
    async def stopped():
        calls.append("stop")

    async with ConsumerHarness(batched) as h:
        for i in range(7):
            await h.send(reward(i))
        await h.catch_up()
        await h.send(reward(7))
    assert calls == ["start", [0, 1, 2], [3, 4, 5], [6], "caught up", [7], "stop"]


async def test_class_consumer_with_a_typed_handle():
    from bus.examples.solve_rate import SolveRate

    app = SolveRate(window=2, print_every=0, out=io.StringIO())
    async with ConsumerHarness(app) as h:
        await h.send(reward(0, 1.0))
        await h.send(reward(1, 0.0))
        await h.send(reward(2, 0.0))
    assert app.report().rewards_seen == 3 and app.report().rolling_solve_rate == 0.0
    assert "rewards=3 rolling_solve_rate=0.000 (last 2)" in app.out.getvalue()

    class Untyped(Analytics):
        topics = ["tasks", "rewards"]

        async def handle(self, event, env):
            self.seen = getattr(self, "seen", []) + [type(event).__name__]

    untyped = Untyped()
    async with ConsumerHarness(untyped) as h:
        await h.send(reward(0))
        await h.send(Task(task_id="t", group_id="t/g0", group_size=1, instruction="x"))
    assert untyped.seen == ["Reward", "Task"]


async def test_tumbling_windows_by_record_time_across_partitions():
    windows = TumblingWindows(size_s=10, grace_s=5)
    closed = []

    @consumer("rewards")
    async def per_window(r: Reward, env):
        closed.extend(windows.add(env.timestamp_ms, r.sample_index))

    @per_window.on_stop
    def flush():
        closed.extend(windows.flush())

    # Two partitions interleaved: partition 1 runs a few seconds behind partition 0.
    arrivals = [(0, 1_000), (0, 9_000), (1, 4_000), (0, 12_000), (1, 8_000), (0, 16_000), (1, 11_000),
                (0, 31_000), (1, 3_000)]
    async with ConsumerHarness(per_window) as h:
        for i, (partition, ts) in enumerate(arrivals):
            await h.send(reward(i), partition=partition, timestamp_ms=ts)
    assert [(w.start_ms, w.items) for w in closed] == [(0, [0, 1, 2, 4]), (10_000, [3, 5, 6]), (30_000, [7])]
    assert windows.late == 1  # the record at 3 s came after its window closed (stream time 31 s)


def test_rolling_window_keeps_the_last_span_of_record_time():
    window = RollingWindow(span_s=10)
    for ts, item in [(1_000, "a"), (5_000, "b"), (3_000, "c"), (12_000, "d")]:
        window.add(ts, item)
    assert window.items == ["c", "b", "d"]  # record-time order; "a" (1 s) fell out at 12 s
    window.add(1_500, "late")
    assert window.late == 1 and len(window) == 3
