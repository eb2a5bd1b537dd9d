"""`rollway up`: supervision of real component processes on a real broker, and the live
view's state on real events read back from Kafka.

The supervision tests run `up` with the light components only (feeder, analytics), so
no model is built and no vLLM starts; the whole stack under `up` is test_e2e_stack.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bus import EventProducer, KafkaConfig, encode, ensure_topics, read_topic
from rollway.commands.up import MAIN_JOB, plan
from rollway.config import given_settings
from rollway.live_state import LiveState
from rollway.live_view import render, status_line
from rollway.log_follow import LogFollower
from rollway.supervisor import ComponentSpec, ComponentStatus, CrashLoop, RestartPolicy, Supervisor
from schemas import Cost, DeadLetter, EvalResult, Heartbeat, Metrics, Reward, Task
from tests.cli import log_events
from tests.conftest import TEST_PARTITIONS, unique
from tests.waiting import leftover_processes, wait_until, wait_until_async

REPO = Path(__file__).resolve().parent.parent
LIGHT_ONLY = ["--without", "sandbox", "--without", "sampler", "--without", "trainer", "--without", "evaluator"]


# -- pure parts ------------------------------------------------------------------------------
def test_restart_backoff_doubles_up_to_the_cap():
    policy = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        RestartPolicy(crash_loop_exits=0)


def test_plan_leaves_out_unknown_commands_and_passes_max_steps():
    known = {"sandbox", "feeder", "sampler", "trainer", "analytics"}  # an install without `evaluator`
    names = [p.name for p in plan(2, [], commands=known)]
    assert names == ["sandbox", "trainer", "sampler-0", "sampler-1", "feeder", "analytics"]
    with_eval = plan(1, ["sandbox"], max_steps=7, commands=known | {"evaluator"})
    assert [p.name for p in with_eval] == ["trainer", "sampler-0", "evaluator", "feeder", "analytics"]
    trainer = with_eval[0]
    assert trainer.argv == ["trainer", "--max-steps", "7"] and trainer.done_on_success
    assert not plan(1, [], commands=known)[1].done_on_success  # without --steps any exit is restarted
    assert with_eval[1].env == {"ROLLWAY_REPLICA_ID": "sampler-0"}
    # Shutdown order: producers of work drain first, the sandbox (grading their last
    # rollouts) goes last.
    stages = {p.kind: p.stop_stage for p in plan(1, [], commands=known | {"evaluator"})}
    assert stages["feeder"] == stages["sampler"] == stages["evaluator"] < stages["trainer"] < stages["sandbox"]


def test_given_settings_are_what_file_and_environment_name(tmp_path):
    """What `rollway up` leaves alone: a key the file or the environment sets, never a default."""
    cfg = tmp_path / "r.toml"
    cfg.write_text('[feeder]\ntasks_dir = "tasks/demo"\n')
    assert given_settings(str(cfg), {}) == {"feeder": {"tasks_dir": "tasks/demo"}}
    assert given_settings(str(cfg), {"ROLLWAY_TRAINER__LEARNING_RATE": "0.5"}) == {
        "feeder": {"tasks_dir": "tasks/demo"}, "trainer": {"learning_rate": "0.5"}}
    assert given_settings(str(cfg), {"ROLLWAY_FEEDER__TASKS_DIR": "x"}) == {"feeder": {"tasks_dir": "x"}}


def test_compose_runs_the_main_job_settings():
    """docker compose runs the same main job as `rollway up`: every MAIN_JOB setting is in
    the compose config with the same value, and each converts to its config field."""
    import tomllib

    import msgspec

    from rollway.config import RollwayConfig

    compose = tomllib.loads(Path("deploy/rollway.compose.toml").read_text())
    defaults = msgspec.to_builtins(RollwayConfig())
    for (section, key), value in MAIN_JOB.items():
        assert key in defaults[section], (section, key)
        typed = msgspec.convert({**defaults[section], key: value}, type(getattr(RollwayConfig(), section)),
                                strict=False)
        assert compose[section][key] == getattr(typed, key), (section, key)
        assert getattr(typed, key) != defaults[section][key], f"{section}.{key} is the default: leave it out"


# -- the supervisor's policy on real processes, with a clock the test moves -------------------
def spec(tmp: Path, name: str, code: str, **kw) -> ComponentSpec:
    return ComponentSpec(name=name, argv=[sys.executable, "-c", code], env=dict(os.environ),
                         log_path=tmp / f"{name}.log", **kw)


def state_of(sup: Supervisor, name: str) -> ComponentStatus:
    return next(s for s in sup.statuses() if s.name == name)


def test_supervisor_backoff_reset_and_crash_loop(tmp_path):
    now = [0.0]
    notes: list[str] = []
    policy = RestartPolicy(backoff_initial_s=1.0, backoff_max_s=4.0, backoff_reset_after_s=10.0,
                           crash_loop_exits=4, crash_loop_window_s=30.0)
    sup = Supervisor([spec(tmp_path, "c", "import sys; sys.exit(3)")], policy, clock=lambda: now[0],
                     notify=notes.append)

    def exited() -> bool:
        sup.tick()
        return state_of(sup, "c").state == "restarting"

    sup.start_all()
    wait_until(exited, 30, "the first exit")  # noticed at t=0: restart at t=1
    assert (state_of(sup, "c").restarts, state_of(sup, "c").last_exit) == (0, 3)
    now[0] = 0.9
    sup.tick()
    assert state_of(sup, "c").state == "restarting"
    now[0] = 1.0
    sup.tick()
    assert (state_of(sup, "c").state, state_of(sup, "c").restarts) == ("running", 1)
    wait_until(exited, 30, "the second exit")  # 2nd quick exit in a row at t=1: 2 s
    now[0] = 2.9
    sup.tick()
    assert state_of(sup, "c").state == "restarting"
    now[0] = 3.0
    sup.tick()
    assert state_of(sup, "c").restarts == 2
    now[0] = 20.0  # this run lasted 17 s >= backoff_reset_after_s: back to 1 s
    wait_until(exited, 30, "the third exit")
    now[0] = 21.0
    sup.tick()
    assert state_of(sup, "c").restarts == 3
    with pytest.raises(CrashLoop) as crash:  # 4 exits within 30 s (t = 0, 1, 20, 21)
        wait_until(lambda: sup.tick() or False, 30, "the fourth exit")
    assert str(crash.value) == (f"c exited 4 times within 30 s (last exit code 3); giving up. "
                                f"See its log: {tmp_path / 'c.log'}")
    assert state_of(sup, "c").state == "crashed"
    exits, restarts = notes[0::2], notes[1::2]
    assert [n.split(" after ")[0] for n in exits] == ["c exited (code 3)"] * 3
    assert [n.split("; ")[1] for n in exits] == [f"restarting in {d} s (see {tmp_path / 'c.log'})" for d in (1, 2, 1)]
    assert [n.split(", pid")[0] for n in restarts] == [f"c restarted (restart {i}" for i in (1, 2, 3)]


def test_supervisor_finished_component_and_staged_stop(tmp_path):
    sup = Supervisor([
        spec(tmp_path, "done", "pass", done_on_success=True),
        spec(tmp_path, "polite", "import time; time.sleep(120)", stop_stage=0),
        spec(tmp_path, "stubborn", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                   "print('ready', flush=True); time.sleep(120)", stop_stage=1),
    ], RestartPolicy())
    sup.start_all()

    def finished() -> bool:
        sup.tick()
        return sup.finished("done")

    wait_until(finished, 30, "the finishing component")  # exit 0 with done_on_success: never restarted
    assert state_of(sup, "done").restarts == 0
    wait_until(lambda: "ready" in (tmp_path / "stubborn.log").read_text(), 30, "SIGTERM ignored")
    sup.stop(grace_s=0.5, min_stage_s=0.5)
    assert [(s.name, s.state, s.last_exit) for s in sup.statuses()] == [
        ("done", "finished", 0), ("polite", "stopped", -signal.SIGTERM), ("stubborn", "stopped", -signal.SIGKILL)]


# -- the view's state on real events ---------------------------------------------------------
def trainer_metrics(step: int, started: float, **values: float) -> Metrics:
    return Metrics(source="trainer", step=step, weight_version=step,
                   values={"process_started_at": started, **values}, created_at=1000.0 + step)


def reward(i: int, score: float, value: float, cheated: bool = False) -> Reward:
    return Reward(trajectory_id=f"t{i}", task_id="task", group_id="g", sample_index=i, attempt="a", score=score,
                  cheated=cheated, reward=value, cost=Cost(generated_tokens=10 * i), created_at=2000.0 + i)


def beat(replica: str, status: str, version: int, tps: float, pause: float, updates: int, at: float) -> Heartbeat:
    return Heartbeat(replica_id=replica, role="sampler", status=status, weight_version=version, tokens_per_s=tps,
                     last_pause_ms=pause, updates_applied=updates, created_at=at)


async def test_view_state_from_real_events_read_back_from_kafka(kafka_config):
    now = 5000.0
    metrics = [
        trainer_metrics(1, 100.0, groups=2, count_groups_dropped_stale=1, count_groups_dropped_zero_variance=2,
                        count_dropped_duplicate=1),
        trainer_metrics(2, 100.0, groups=2, count_groups_dropped_stale=3, count_groups_dropped_zero_variance=2,
                        count_dropped_duplicate=2, count_trajectories_dropped_stale=3),
        # The trainer restarted: its counters start from zero again.
        trainer_metrics(3, 200.0, groups=1, count_groups_dropped_stale=1, count_groups_dropped_abandoned=1,
                        count_dropped_late=3, reward_mean=0.5, entropy_full=2.0,
                        entropy_kept=1.5, mismatch_kl_k3=0.0012, staleness_mean=0.75, staleness_max=2.0,
                        tokens_per_s=1000.0, published_version=2.0),
        trainer_metrics(3, 200.0, groups=1, count_groups_dropped_stale=1),  # step 3 again: counted once
        Metrics(source="feeder", values={"published_groups": 10.0}, created_at=1001.0),
    ]
    beats = [
        beat("sampler-0", "serving", 2, 50.0, 12.5, 2, now - 1),
        beat("sampler-1", "serving", 1, 30.0, 40.0, 1, now - 2),
        beat("sampler-1", "serving", 0, 99.0, 0.0, 0, now - 60),  # older beat, read later: ignored
        beat("sampler-2", "stopped", 2, 99.0, 0.0, 0, now - 3),  # not serving: no tokens/s
    ]
    rewards = [reward(1, 1.0, 0.9), reward(2, 0.0, -0.1), reward(3, 1.0, 0.0, cheated=True), reward(4, 1.0, 0.8),
               reward(5, 0.0, 0.0), reward(2, 0.0, -0.1)]  # the last one re-published: counted once
    evals = [EvalResult(split="family:heldout", weight_version=v, pass_at_1=p, tasks=100, samples=1,
                        created_at=3000.0 + i)
             for i, (v, p) in enumerate([(0, 0.15), (4, 0.35), (2, 0.25)])]
    letter = DeadLetter(topic="x.tasks", partition=0, offset=7, error="cannot decode Task", error_kind="decode")
    prefix = kafka_config.topic_prefix
    async with EventProducer(kafka_config) as producer:
        for event in metrics + beats + evals + [letter]:
            await producer.publish(event)
        for r in rewards:  # one partition: the rolling window depends on their order
            value, headers = encode(r)
            await producer.publish_raw(prefix + "rewards", value, key=r.trajectory_id.encode(), headers=headers,
                                       partition=0)
        await producer.publish_raw(prefix + "metrics", b"\x00\xffgarbage", key=b"bad",
                                   headers=[("rollway-type", b"Metrics")])
    expected = len(metrics) + len(beats) + len(rewards) + len(evals) + 1
    state = LiveState(window=4)
    seen = 0
    async with LogFollower(kafka_config, ["metrics", "health", "rewards", "evals", "dlq"]) as follower:
        async def all_read() -> bool:
            nonlocal seen
            for env in await follower.poll(timeout_ms=200):
                state.apply(env.event)
                seen += 1
            return seen == expected and follower.undecodable == 1
        await wait_until_async(all_read, 30, "every event read back", poll_s=0.2)
        state.undecodable = follower.undecodable
    state.note("feeder restarted (restart 1, pid 123)")
    comps = [ComponentStatus("feeder", "running", 1, 123, -9, "var/logs/feeder.log"),
             ComponentStatus("trainer", "restarting", 2, None, 1, "var/logs/trainer.log")]
    m = state.model(now=now, elapsed_s=65.0, components=comps)

    assert m.train_step == 3 and m.published_version == 2
    assert m.groups_trained == 5
    assert m.groups_dropped == {"abandoned": 1, "stale": 4, "zero_variance": 2}
    assert m.trajectories_dropped == {"duplicate": 2, "late": 3, "stale": 3}
    assert m.groups_published == 10
    assert m.sampling_tokens_per_s == 80.0 and m.training_tokens_per_s == 1000.0
    assert [(r.replica_id, r.weight_version) for r in m.replicas] == [("sampler-0", 2), ("sampler-1", 1),
                                                                     ("sampler-2", 2)]
    assert m.apply_pause_ms == 40.0
    assert m.rewards_seen == 5 and m.window_rewards == 4
    assert m.reward_mean == pytest.approx((-0.1 + 0.0 + 0.8 + 0.0) / 4)
    assert m.solve_rate == 0.25  # t3 was a cheat, t1 left the window
    assert m.step_reward_mean == 0.5
    assert (m.eval_latest.weight_version, m.eval_latest.pass_at_1) == (4, 0.35)
    assert (m.eval_first.weight_version, m.eval_first.pass_at_1) == (0, 0.15)
    assert (m.entropy_full, m.entropy_kept, m.mismatch_kl, m.staleness_mean, m.staleness_max) == \
        (2.0, 1.5, 0.0012, 0.75, 2.0)
    assert m.dead_letters == 1 and m.dead_letters_by_kind == {"decode": 1}
    assert m.last_dead_letter == "x.tasks@7: cannot decode Task"
    assert m.undecodable == 1

    line = status_line(m)
    for part in ("[0:01:05]", "step 3", "weights sampler-0=v2 sampler-1=v1 sampler-2=v2", "tok/s 80",
                 "groups 5 trained/7 dropped abandoned=1 stale=4 zero_variance=2", "reward 0.175", "solve 0.250", "pass@1 0.350@v4",
                 "entropy 1.500", "mismatch 0.00120", "stale 0.75", "pause 40ms", "dlq 1",
                 "| feeder:running(1restart) trainer:restarting(2restarts)"):
        assert part in line, (part, line)

    from rich.console import Console

    console = Console(record=True, width=220, color_system=None)
    console.print(render(m))
    text = console.export_text()
    for part in ("0.350 @ v4 (family:heldout, 100 tasks x 1)  first 0.150 @ v0", "trained 5  dropped 7 (abandoned 1, "
                 "stale 4, zero_variance 2)  published 10", "duplicate 2, late 3, stale 3",
                 "feeder restarted (restart 1, pid 123)", "killed by SIGKILL", "var/logs/trainer.log", "1 undecodable records skipped by the view"):
        assert part in text, (part, text)


# -- supervision under a real `rollway up` ---------------------------------------------------
def up_config(tmp: Path, prefix: str, tasks_dir: str | None, **restart: float) -> Path:
    partitions = ", ".join(f'"{k}" = {v}' for k, v in TEST_PARTITIONS.items())
    restart_lines = "\n".join(f"{k} = {v}" for k, v in restart.items())
    path = tmp / "rollway.toml"
    path.write_text(f"""
[kafka]
topic_prefix = "{prefix}"
partitions = {{ {partitions} }}
[feeder]
{"" if tasks_dir is None else f'tasks_dir = "{tasks_dir}"'}
group_size = 2  # the smallest group that can train (rollway.config refuses 1)
groups_per_second = 20.0
# Without samplers no reward ever comes back: each feeder process publishes exactly
# this many groups, then waits.
max_outstanding_groups = 2
[up]
status_every_s = 0.5
grace_s = 20.0
[up.restart]
{restart_lines}
""")
    return path


def start_up(config: Path, tmp: Path, kafka_bootstrap: str, *extra: str,
             without: list[str] = LIGHT_ONLY) -> tuple[subprocess.Popen, Path, Path]:
    out = tmp / "up.out"
    logs = tmp / "logs"
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollway.cli", "--config", str(config), "up", "--no-tui", "--log-dir", str(logs),
         *without, *extra],
        cwd=REPO, env=env, stdout=open(out, "w"), stderr=subprocess.STDOUT,
    )
    return proc, out, logs


def run_up_to_exit(config: Path, tmp: Path, kafka_bootstrap: str, *extra: str, timeout: float,
                   without: list[str] = LIGHT_ONLY) -> tuple[int, str, Path]:
    """Start `rollway up` and wait for it to stop by itself: (exit code, its output, log dir)."""
    proc, out, logs = start_up(config, tmp, kafka_bootstrap, *extra, without=without)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, out.read_text(), logs


def up_events(logs: Path, name: str) -> list[dict]:
    return log_events(logs / "up.log", name)


def stop_up(proc: subprocess.Popen, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


async def test_killed_component_is_restarted_and_the_stack_goes_on(kafka_bootstrap, tmp_path):
    prefix = f"{unique('up-')}."
    config = up_config(tmp_path, prefix, f"{REPO}/tasks/demo", backoff_initial_s=0.2)
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)
    proc, out, logs = start_up(config, tmp_path, kafka_bootstrap)
    try:
        async def tasks(n: int) -> list:
            got = [e.event for e in await read_topic(kafka, "tasks")]
            return got if len(got) >= n else []

        first = await wait_until_async(lambda: tasks(2), 60, "the feeder's first 2 groups", proc=proc, poll_s=0.2)
        assert len(first) == 2 and all(isinstance(t, Task) for t in first)
        started = {e["component"]: e["pid"] for e in up_events(logs, "component started")}
        assert set(started) == {"feeder", "analytics"}
        os.kill(started["feeder"], signal.SIGKILL)

        restarted = wait_until(lambda: up_events(logs, "component restarted"), 30, "the feeder's restart", proc=proc, poll_s=0.1)
        assert [(e["component"], e["restarts"]) for e in restarted] == [("feeder", 1)]
        assert restarted[0]["pid"] != started["feeder"]
        exited = up_events(logs, "component exited; restarting")
        assert [(e["component"], e["returncode"]) for e in exited] == [("feeder", -signal.SIGKILL)]
        # The stack goes on: the new feeder process publishes its own 2 groups.
        after = await wait_until_async(lambda: tasks(4), 60, "2 more groups from the restarted feeder", proc=proc, poll_s=0.2)
        assert len(after) == 4 and len({t.group_id for t in after}) == 4
        line = wait_until(lambda: [ln for ln in out.read_text().splitlines()
                                   if "feeder:running(1restart)" in ln and "analytics:running" in ln],
                          30, "a status line with the restart count", proc=proc)
        assert line[-1].endswith("| feeder:running(1restart) analytics:running")
        assert "rollway up: feeder exited (killed by SIGKILL)" in out.read_text()
    finally:
        code = stop_up(proc)
    text = out.read_text()
    assert code == 0, text
    assert "rollway up: SIGTERM received; stopping components" in text
    assert "rollway up: stopped (train step -, restarts 1," in text
    assert leftover_processes(config) == []
    # Both feeder processes logged to the same file: the JSON logs stay in the log dir.
    # the killed one never got to say it; the restarted one drained on SIGTERM
    assert (logs / "feeder.log").read_text().count("feeder stopped: stopped; published 2 groups\n") == 1


async def test_crash_loop_gives_up_naming_the_component_and_its_log(kafka_bootstrap, tmp_path):
    prefix = f"{unique('up-')}."
    config = up_config(tmp_path, prefix, "/nonexistent/tasks", backoff_initial_s=0.1, crash_loop_exits=3,
                       crash_loop_window_s=120)
    code, text, logs = run_up_to_exit(config, tmp_path, kafka_bootstrap, timeout=120)
    assert code == 1, text
    assert (f"rollway up: feeder exited 3 times within 120 s (last exit code 2); giving up. "
            f"See its log: {logs / 'feeder.log'}") in text
    assert [e["restarts"] for e in up_events(logs, "component restarted")] == [1, 2]
    gave_up = up_events(logs, "component crash loop; giving up")
    assert [(e["component"], e["exits"]) for e in gave_up] == [("feeder", 3)]
    assert (logs / "feeder.log").read_text().count("tasks folder /nonexistent/tasks does not exist") == 3
    assert leftover_processes(config) == []  # analytics was stopped with the stack


def test_minutes_stops_the_stack_cleanly(kafka_bootstrap, tmp_path):
    prefix = f"{unique('up-')}."
    config = up_config(tmp_path, prefix, None)  # no feeder.tasks_dir: up's default task set
    code, text, logs = run_up_to_exit(config, tmp_path, kafka_bootstrap, "--without", "feeder", "--minutes", "0.05", timeout=90)
    assert code == 0, text
    assert f"rollway up: 1 components (analytics), training on family:train, Kafka at {kafka_bootstrap}" in text
    assert "rollway up: --minutes 0.05 elapsed; stopping components" in text
    assert [e["component"] for e in up_events(logs, "component stopped")] == ["analytics"]
    assert leftover_processes(config) == []



@pytest.mark.slow  # a real trainer process (torch) under `up`
async def test_steps_stops_the_stack_after_exactly_that_train_step(kafka_bootstrap, tmp_path, tiny_model_path):
    from tests.synthetic import load_tiny, make_task_groups, to_events

    prefix = f"{unique('up-')}."
    kafka = KafkaConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, partitions=dict(TEST_PARTITIONS))
    await ensure_topics(kafka)
    model, tok = load_tiny(str(tiny_model_path))
    groups = make_task_groups(model, tok, 3, group_size=2, max_new_tokens=8, seed=5)  # data for 3 steps
    async with EventProducer(kafka) as producer:
        for traj in (t for group in groups for t in group):
            chunks, rew = to_events(traj, chunk_tokens=12)
            for chunk in chunks:
                await producer.publish(chunk)
            await producer.publish(rew)
    config = up_config(tmp_path, prefix, None)
    config.write_text(config.read_text() + f"""
[syncer]
store_url = "file://{tmp_path}/weights"
[trainer]
model_path = "{tiny_model_path}"
checkpoint_dir = "{tmp_path}/checkpoints"
groups_per_step = 1
num_threads = 1
""")
    only_trainer = [arg for kind in ("sandbox", "sampler", "evaluator", "feeder", "analytics")
                    for arg in ("--without", kind)]
    code, text, logs = run_up_to_exit(config, tmp_path, kafka_bootstrap, "--steps", "2", without=only_trainer, timeout=180)  # it stops by itself
    assert code == 0, text
    assert "rollway up: 1 components (trainer)" in text  # the model exists: nothing is built
    # Either the view saw step 2 or the trainer's exit 0 at --max-steps came first.
    assert "rollway up: --steps 2 reached; stopping components" in text
    assert "rollway up: stopped (train step 2, restarts 0," in text
    steps = [e.event.step for e in await read_topic(kafka, "train-steps")]
    assert steps == [1, 2]  # the trainer ran --max-steps 2, though a third group was waiting
    assert leftover_processes(config) == []


def test_model_init_is_asked_for_the_samplers_format_where_it_can_build_it():
    from rollway.commands.up import model_command

    assert model_command("m") == ["model", "init", "--out", "m"]
    assert model_command("m", "chatml-hermes") == ["model", "init", "--out", "m", "--format", "chatml-hermes"]
    assert model_command("m", "rollway") == ["model", "init", "--out", "m", "--format", "rollway"]
    # Every family the sampler speaks has a warm start in its own layout (the table in
    # sampler/formats/tokenizers.py); "auto" leaves it to init's default.
    for family in ("qwen3", "qwen3-coder", "llama3-json"):
        assert model_command("m", family) == ["model", "init", "--out", "m", "--format", family]


def test_an_outdated_warm_start_is_rebuilt_with_the_settings_it_records(tmp_path):
    """A warm start built by hand with other settings (2,000 SFT steps, another seed and
    teacher) and then outdated by a source edit comes back with the same settings: the
    command up runs parses to exactly the recorded config, not to init's defaults."""
    import json

    import msgspec

    from rollway.cli import build_parser
    from rollway.commands.model import init_config
    from rollway.commands.up import model_command
    from trainer.sft import SFTConfig
    from trainer.warm_start import MARKER, WarmStartConfig

    recorded = WarmStartConfig(seed=3, format="chatml-hermes",
                               sft=SFTConfig(steps=2000, seed=3, premature_submit_rate=0.25))
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / MARKER).write_text(json.dumps({"config": msgspec.to_builtins(recorded), "cache_key": "0" * 12}))

    argv = model_command(str(folder))
    assert argv[argv.index("--steps") + 1] == "2000"
    assert init_config(build_parser().parse_args(argv)) == recorded
    # The sampler's configured format wins over the recorded one; the rest is kept.
    rollway_argv = model_command(str(folder), "rollway")
    assert init_config(build_parser().parse_args(rollway_argv)) == msgspec.structs.replace(recorded, format="rollway")
    # A marker this version cannot read, or none: init's defaults.
    (folder / MARKER).write_text(json.dumps({"config": {"no_such_setting": 1}}))
    assert model_command(str(folder)) == ["model", "init", "--out", str(folder)]
    (folder / MARKER).write_text("{truncated")
    assert model_command(str(folder), "chatml-hermes") == ["model", "init", "--out", str(folder), "--format",
                                                          "chatml-hermes"]
    assert init_config(build_parser().parse_args(model_command(str(tmp_path / "none")))) == WarmStartConfig()
