"""The procedural task family (tasks/family): API, determinism, split disjointness, id
resolution, the feeder serving it over real Kafka, and the real grader on a sample of
every kind and split (reference solution written through the sandbox's write tool
passes; the untouched repository fails)."""

from __future__ import annotations

import asyncio
import os
import re
import uuid

import msgspec
import pytest
import pytest_asyncio

from bus import EventConsumer
from sandbox.client import SandboxClient
from sandbox.config import RewardConfig, SandboxConfig
from schemas import Reward, Task
from tasks.config import FeederConfig
from tasks.family import KINDS, FamilyError, generate, resolve, split_names
from tasks.family.base import split_of_fingerprint
from tasks.feeder import Feeder
from tasks.store import TaskStore
from tests.sandbox_helpers import live_sandbox

N = 1200  # per split: 300 of each kind


@pytest.fixture(scope="module")
def splits() -> dict[str, list]:
    return {split: generate(split, N, seed=0) for split in split_names}


def behaviour(spec) -> str:
    from tasks.family import _KINDS

    kind = spec.metadata["kind"]
    return _KINDS[kind].fingerprint(tuple(spec.task_id.split(".")[2:]))


def normalised_functions(spec) -> set[str]:
    """Each solution function as (domain, body) with its argument replaced by a
    placeholder outside string literals (fix tasks share arith's integer domain: the
    same ``n * 3`` in ``text`` repeats a string, a different behaviour)."""
    domain = "arith" if spec.metadata["kind"] == "fix" else spec.metadata["kind"]
    out = set()
    for text in spec.solution.values():
        for _name, arg, body in re.findall(r"def (\w+)\((\w+)\):\n    return (.*)\n", text):
            parts = re.split(r"('[^']*')", body)
            out.add(domain + ":" + "".join(p if p.startswith("'") else re.sub(rf"\b{arg}\b", "ARG", p)
                                           for p in parts))
    return out


def normalised_tests(spec) -> str:
    """Hidden tests with every identifier of the task renamed: what a renamed copy shares."""
    text = "".join(spec.hidden_tests.values())
    for module in spec.files:
        text = text.replace(module.removesuffix(".py"), "MOD")
    for name in re.findall(r"def (\w+)\(", "".join(spec.solution.values())):
        text = re.sub(rf"\b{name}\b", "FUNC", text)
    return text


def test_api_names_and_errors():
    assert KINDS == ("arith", "text", "lists", "fix")
    assert tuple(split_names) == ("train", "heldout", "heldout-names") == split_names()
    with pytest.raises(ValueError, match=r"unknown split 'test'; valid splits: train, heldout, heldout-names"):
        generate("test", 3)
    with pytest.raises(ValueError, match=r"valid kinds: arith, text, lists, fix"):
        generate("train", 3, kinds=["sorting"])
    with pytest.raises(ValueError, match="not a family task id"):
        resolve("fam.nosuchkind.a.b")
    with pytest.raises(FamilyError, match="bad operation 'add77'"):
        resolve("fam.arith.calc.scale.n.mul3_add77")


def test_deterministic_and_prefix_stable(splits):
    again = generate("train", N, seed=0)
    assert [msgspec.to_builtins(s) for s in again] == [msgspec.to_builtins(s) for s in splits["train"]]
    assert [s.task_id for s in generate("train", 40, seed=0)] == [s.task_id for s in splits["train"][:40]]
    other_seed = [s.task_id for s in generate("train", 40, seed=1)]
    assert other_seed != [s.task_id for s in splits["train"][:40]]


def test_shape_kinds_and_metadata(splits):
    for split, specs in splits.items():
        assert len({s.task_id for s in specs}) == N  # distinct instances
        assert [s.metadata["kind"] for s in specs[:8]] == list(KINDS) * 2
        for spec in specs:
            assert spec.task_set == f"family:{split}" and spec.metadata["split"] == split
            assert spec.task_id.startswith(f"fam.{spec.metadata['kind']}.")
            # Small enough for a 512-1024-token context with the tool loop.
            assert len(spec.instruction) < 320 and sum(map(len, spec.files.values())) < 200
            assert len(normalised_functions(spec)) >= 1


def test_thousands_of_distinct_instances():
    specs = generate("train", 4000, seed=3)
    assert len({s.task_id for s in specs}) == 4000
    assert len({behaviour(s) for s in specs}) > 500


def test_splits_are_disjoint_by_behaviour_and_content(splits):
    train, held = splits["train"], splits["heldout"]
    assert not {s.task_id for s in train} & {s.task_id for s in held}
    train_b, held_b = {behaviour(s) for s in train}, {behaviour(s) for s in held}
    assert not train_b & held_b
    assert all(split_of_fingerprint(b) == "train" for b in train_b)
    # No held-out function body (names normalised) is ever a train solution's function,
    # including the untouched helper of fix tasks.
    train_f = set().union(*(normalised_functions(s) for s in train))
    held_f = set().union(*(normalised_functions(s) for s in held))
    assert train_f and held_f and not train_f & held_f
    # Renamed copies: hidden tests with all identifiers normalised never coincide.
    assert not {normalised_tests(s) for s in train} & {normalised_tests(s) for s in held}
    # The held-out split is a real share of the space, not a handful of behaviours.
    assert len(held_b) > 150


def test_ids_resolve_to_the_same_task_from_any_store(splits):
    demo = TaskStore("tasks/demo")
    family = TaskStore("family:heldout", family_count=60, family_seed=0)
    assert family.ids() == [s.task_id for s in splits["heldout"][:60]]
    for spec in splits["train"][:50] + splits["heldout"][:50]:
        assert resolve(spec.task_id) == spec
        assert demo.get(spec.task_id) == spec  # the grader's store regenerates from the id
    with pytest.raises(KeyError, match="bad operation"):
        demo.get("fam.arith.calc.scale.n.mul3_add77")
    with pytest.raises(ValueError, match="valid splits: train, heldout"):
        TaskStore("family:validation")
    with pytest.raises(ValueError, match="valid splits"):
        FeederConfig(tasks_dir="family:dev")


async def test_feeder_serves_the_family(kafka_config):
    cfg = FeederConfig(tasks_dir="family:train", family_tasks=30, group_size=2, groups_per_second=200,
                       max_outstanding_groups=5, max_groups=5, replay_rewards=False, metrics_interval_s=3600)
    store = TaskStore(cfg.tasks_dir, family_count=cfg.family_tasks, family_seed=cfg.family_seed)
    feeder = Feeder(cfg, kafka_config, store)
    assert await asyncio.wait_for(feeder.run(), 60) == "published max_groups=5"
    seen: list[Task] = []
    async with EventConsumer(kafka_config, ["tasks"], group_id=f"t-{uuid.uuid4().hex[:6]}") as consumer:
        async def read() -> None:
            async for env in consumer:
                seen.append(env.event)
                await consumer.ack(env)
                if len(seen) == 5:
                    return
        await asyncio.wait_for(read(), 60)
    for task in seen:
        spec = resolve(task.task_id)
        assert task.task_set == "family:train" and task.instruction == spec.instruction
        assert task.files == spec.files and task.metadata["kind"] == spec.metadata["kind"]


# -- the real grader ---------------------------------------------------------------------
PER_KIND = 2  # per kind and split: 16 tasks, 32 gradings


def graded_sample() -> list:
    return [s for split in split_names for kind in KINDS
            for s in generate(split, PER_KIND, seed=11, kinds=[kind])] + long_sample()


def long_sample() -> list:
    """The long forms (three operations / steps) of the kinds that have one."""
    return generate("train", 2, seed=11, kinds=["arith", "text"], long_share=1.0)


def chain_length(spec) -> int:
    return len(spec.task_id.split(".")[-1].split("_"))


def test_long_forms_are_drawn_by_share_and_leave_the_other_draws_alone():
    short = generate("train", 400, seed=3)
    long_ = generate("train", 400, seed=3, long_share=1.0)
    by_kind = lambda specs, k: [s.task_id for s in specs if s.metadata["kind"] == k]  # noqa: E731
    for kind in ("lists", "fix"):  # no long form: the same draws
        assert by_kind(long_, kind) == by_kind(short, kind)
    for kind in ("arith", "text"):
        assert {chain_length(s) for s in long_ if s.metadata["kind"] == kind} == {3}
        assert {chain_length(s) for s in short if s.metadata["kind"] == kind} == {1, 2}
    assert generate("train", 400, seed=3, long_share=0.0) == short
    for seed in (0, 1, 2):
        specs = [s for s in generate("train", 2000, seed=seed, long_share=0.3) if s.metadata["kind"] in ("arith", "text")]
        share = sum(chain_length(s) == 3 for s in specs) / len(specs)
        assert 0.25 <= share <= 0.35, (seed, share)
    spec = long_sample()[0]
    assert resolve(spec.task_id) == spec and ", then " in spec.instruction.split(", then ", 1)[1]
    assert spec.metadata["skill"].count("_") == 2  # its own skill: pooled apart from the short chains
    with pytest.raises(FamilyError, match="long_share must lie in"):
        generate("train", 4, long_share=1.5)
    with pytest.raises(FamilyError, match="need 1 to 3 operations"):
        resolve("fam.arith.calc.scale.n.add2_add3_add4_add5")


def test_the_feeders_store_draws_long_forms_by_its_setting():
    with pytest.raises(msgspec.ValidationError, match="family_long_share must lie in"):
        msgspec.convert({"family_long_share": 1.5}, FeederConfig)
    store = TaskStore("family:train", family_count=40, family_seed=1, family_long_share=1.0)
    lengths = {chain_length(s) for s in store if s.metadata["kind"] in ("arith", "text")}
    assert lengths == {3}
    assert [s.task_id for s in TaskStore("family:train", family_count=40, family_seed=1)] == [
        s.task_id for s in generate("train", 40, seed=1)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def graded(tmp_path_factory) -> dict[tuple[str, bool], Reward]:
    sample = graded_sample()
    store = TaskStore("tasks/demo")  # family ids resolve from the id alone
    cfg = SandboxConfig(max_sessions=2 * len(sample), max_concurrent_commands=max(2, os.cpu_count() or 2),
                        command_queue_timeout_s=600.0, workspace_root=str(tmp_path_factory.mktemp("fam-ws")))
    async with live_sandbox(cfg, RewardConfig(), store) as live, SandboxClient(live.url) as client:

        async def grade(spec, with_solution: bool) -> Reward:
            sid = await client.create_session(spec.task_id)
            if with_solution:
                for path, content in spec.solution.items():
                    await client.write_file(sid, path, content)
            return await client.submit(sid, trajectory_id=f"{spec.task_id}-{with_solution}")

        jobs = [(s, w) for s in sample for w in (True, False)]
        rewards = await asyncio.gather(*(grade(*job) for job in jobs))
        return {(s.task_id, w): r for (s, w), r in zip(jobs, rewards)}


@pytest.mark.parametrize("task_id", [s.task_id for s in graded_sample()])
def test_reference_passes_and_untouched_repo_fails(graded, task_id):
    solved, untouched = graded[(task_id, True)], graded[(task_id, False)]
    assert solved.cheated is False and solved.reason == "", solved.reason
    assert solved.score == 1.0 and solved.tests_passed == solved.tests_total >= 5
    assert untouched.cheated is False, untouched.reason
    assert untouched.score == 0.0 and untouched.tests_passed < untouched.tests_total == solved.tests_total
