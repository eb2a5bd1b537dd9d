"""Mean reward per weight version: the README's consumer example, and its test's subject
(tests/test_consumers.py feeds it events without a broker).

    python -m bus.examples.mean_reward               # rebuild from the log, then follow live
    python -m bus.examples.mean_reward --until-end   # one-shot report

It joins no consumer group, so every start reads ``rollway.rewards`` from the beginning:
the totals are rebuilt from the log after a restart instead of starting from nothing.
"""

from __future__ import annotations

from collections import defaultdict

from bus.analytics import Envelope, consumer
from schemas import Reward

totals: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])  # version -> [sum, count]


@consumer("rewards")
async def mean_reward(reward: Reward, env: Envelope) -> None:
    total = totals[reward.weight_version]
    total[0] += reward.reward
    total[1] += 1


@mean_reward.on_stop
def report() -> None:
    for version, (reward_sum, count) in sorted(totals.items()):
        print(f"version {version}: mean reward {reward_sum / count:.3f} over {int(count)} rewards")


if __name__ == "__main__":
    from rollway.consumers import run_consumers  # the script's entry: reads the config, JSON logs

    run_consumers([mean_reward])
