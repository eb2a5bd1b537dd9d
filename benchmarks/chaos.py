"""Chaos run: the real stack trains while a seeded schedule breaks it; then the log is audited.

    .venv/bin/python benchmarks/chaos.py            # full schedule, seed 0
    .venv/bin/python benchmarks/chaos.py --short    # the test suite's
    .venv/bin/python benchmarks/chaos.py --seeds 5  # seeds 0-4 in a row: a table per seed, then a summary
    .venv/bin/python benchmarks/chaos.py --seeds 0,1,2,3,4,11
    .venv/bin/python benchmarks/chaos.py --short --secure   # on SASL/SCRAM + ACLs (#32)

Everything is a real process: a 3-node Kafka (``rollway.broker.LocalKafka``, RF 3,
min.insync.replicas 2, passed to the components as ``KAFKA_BOOTSTRAP_SERVERS`` the way a
user points ``rollway`` at an external cluster), and ``rollway sandbox``, ``rollway
feeder``, two ``rollway sampler`` and ``rollway trainer`` (weights through the syncer
into the file object store ``rollway up`` uses, ``file://``). Samplers run the timing
engine: tokens are drawn, not computed, so two shared cores can run two samplers, the
sandbox's real bwrap grading, the trainer's real step on the tiny model and three
brokers at once; everything after the engine (agent loop, sandbox calls, chunks,
rewards, the weight subscriber fetching, verifying and applying versions) is the real
path. (TorchEngine on the tiny model would spend the cores on generating text the
sandbox rejects, and slow every fault's recovery, without exercising anything the
faults attack.)

Faults (``--short`` runs the first four; the order after ``garbage`` is shuffled by
``--seed``):

* ``garbage``: undecodable records into every topic (first, so every reader that
  restarts later meets them);
* ``sampler``: SIGKILL a sampler, restart it;
* ``trainer-checkpoint``: arm the failpoint ``checkpoint.before_rename`` (bus/failpoints),
  SIGKILL the trainer when it hangs there (checkpoint files written, not renamed in),
  restart it;
* ``trainer-freeze``: SIGSTOP the trainer, start a replacement, let it train, SIGCONT
  the old one: it must stop fenced (exit 4) and write nothing after it woke (no step,
  no weights, no checkpoint). The seed picks where it freezes: inside a checkpoint
  write (paused at ``checkpoint.before_rename:pause``, files written, not renamed in:
  the replacement starts while that write is in flight, the seed-11 failure of issue
  #30) or at whatever it was doing;
* ``trainer-publish``: as ``trainer-checkpoint`` at ``weights.before_announce`` (the
  version's objects and manifest stored, not announced);
* ``sandbox``, ``feeder``: SIGKILL, restart;
* ``broker``: SIGKILL one of the three brokers, train on with two, restart it;
* ``weights-store``: SIGKILL a sampler and SIGSTOP the trainer; flip a byte in a chunk
  of the newest keyframe and truncate the newest version's delta manifest (every path
  to it crosses one); restart the sampler, wait until it logs a failed update, SIGCONT
  the trainer: it must publish a keyframe the replica can load.

After each fault the run waits for training to progress (``--progress-steps`` new
steps). Then the feeder stops, the stack drains (every issued group ends), samplers
settle on the newest version, everything stops, and the audit prints one row per
invariant. Exit 0 only when every invariant holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bus import codec  # noqa: E402
from harness import cpu_name, load_average  # noqa: E402
from bus.config import KafkaConfig  # noqa: E402
from bus.security import client_security  # noqa: E402
from bus.topics import TOPICS  # noqa: E402

FULL_SCHEDULE = ["garbage", "sampler", "trainer-checkpoint", "trainer-freeze", "trainer-publish", "sandbox",
                 "feeder", "broker", "weights-store"]
SHORT_SCHEDULE = ["garbage", "sampler", "trainer-checkpoint", "trainer-freeze"]
# Topics whose garbage a consumer group of the running stack owns and dead-letters
# (tasks: samplers; trajectories, rewards: the trainer; train-steps: the trainer when it
# restarts, once across restarts). Garbage on the other topics stays in the log, skipped
# by the readers this run has without a dead letter: weights (its owner, the evaluator,
# is not run here; samplers read it without a group, so a letter per replica would say
# nothing), health, metrics, evals (views: the trainer's health follower, `rollway up`'s
# view, reports), and the dlq itself (garbage there is its own letter). The audit
# counts those per topic and checks they are still in the log.
DEAD_LETTERED_TOPICS = ("tasks", "trajectories", "rewards", "train-steps")
GARBAGE_PER_TOPIC = 2
MODEL_NAME = "chaos"


def stack_config(work: Path, prefix: str, model: Path, sandbox_port: int, seed: int) -> str:
    return f"""
model_name = "{MODEL_NAME}"
[logging]
level = "info"
[kafka]
topic_prefix = "{prefix}"
request_timeout_ms = 10000
[kafka.partitions]
tasks = 4
trajectories = 3
rewards = 3
health = 1
metrics = 1
[kafka.handler_retry]
window_s = 60.0
[syncer]
store_url = "file://{work}/weights"
keyframe_every = 4
retry_delay_s = 1.0
[sampler]
engine = "timing"
model_path = "{model}"
sandbox_url = "http://127.0.0.1:{sandbox_port}"
max_model_len = 1024
max_turns = 3
max_tokens_per_turn = 48
max_total_tokens = 640
max_tasks_in_flight = 2
heartbeat_interval_s = 1.0
consumer_session_timeout_ms = 6000
[sampler.timing]
tokens_per_s = 100.0
median_tokens = 24
submit_probability = 0.5
seed = {seed}
[sandbox]
port = {sandbox_port}
tasks_dir = "{REPO}/tasks/demo"
[reward]
# Nothing solves a demo task here; a length penalty makes a group's rewards differ, so
# groups are trained instead of dropped for zero variance.
length_penalty_per_token = 0.001
length_penalty_in_unconstrained = true
[trainer]
model_path = "{model}"
checkpoint_dir = "{work}/checkpoints"
groups_per_step = 1
checkpoint_every = 2
keep_checkpoints = 3
publish_every = 1
max_staleness = 4
num_threads = 1
session_timeout_ms = 6000
held_drops_max_s = 5.0
learning_rate = 1e-3
muon_learning_rate = 1e-3
[feeder]
tasks_dir = "{REPO}/tasks/demo"
group_size = 2
groups_per_second = 1.0
max_outstanding_groups = 4
seed = {seed}
"""


# -- processes ---------------------------------------------------------------------------------

@dataclass
class Component:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log: Path | None = None
    starts: int = 0


class Stack:
    """The components as child processes; each start logs to ``logs/<name>.<n>.log``."""

    def __init__(self, work: Path, config: Path, bootstrap: str) -> None:
        self.work = work
        self.config = config
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "PYTHONUNBUFFERED": "1"}
        self.components: dict[str, Component] = {}
        self.retired: list[tuple[str, subprocess.Popen, Path]] = []  # processes replaced or killed

    def add(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Component:
        comp = Component(name, argv, env or {})
        self.components[name] = comp
        return comp

    def start(self, name: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        comp = self.components[name]
        comp.starts += 1
        comp.log = self.logs / f"{name}.{comp.starts}.log"
        env = {**self.env, "ROLLWAY_REPLICA_ID": name, **comp.env, **(extra_env or {})}
        with open(comp.log, "wb") as out:
            comp.proc = subprocess.Popen([sys.executable, "-m", "rollway.cli", "--config", str(self.config),
                                          *comp.argv], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        return comp.proc

    def signal(self, name: str, sig: int) -> None:
        comp = self.components[name]
        assert comp.proc is not None
        comp.proc.send_signal(sig)

    def retire(self, name: str) -> subprocess.Popen:
        """Forget the running process of ``name`` (killed or left to be fenced)."""
        comp = self.components[name]
        assert comp.proc is not None and comp.log is not None
        self.retired.append((name, comp.proc, comp.log))
        proc, comp.proc = comp.proc, None
        return proc

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.retire(name).wait(30)

    def check_alive(self) -> None:
        for comp in self.components.values():
            if comp.proc is not None and comp.proc.poll() is not None:
                raise ChaosError(f"{comp.name} exited with {comp.proc.returncode} unasked; "
                                 f"log {comp.log}:\n{tail(comp.log)}")

    def stop_all(self, grace: float = 60.0) -> dict[str, int | None]:
        order = [["feeder"], [n for n in self.components if n.startswith("sampler")], ["trainer"], ["sandbox"]]
        codes: dict[str, int | None] = {}
        for names in order:
            live = [self.components[n] for n in names if n in self.components and self.components[n].proc]
            for comp in live:
                if comp.proc.poll() is None:
                    comp.proc.send_signal(signal.SIGTERM)
            for comp in live:
                try:
                    codes[comp.name] = comp.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    comp.proc.kill()
                    codes[comp.name] = comp.proc.wait(30)
        return codes

    def kill_everything(self) -> None:
        procs = [c.proc for c in self.components.values() if c.proc is not None]
        procs += [p for _, p, _ in self.retired]
        for proc in procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                    proc.wait(30)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass


class ChaosError(RuntimeError):
    """The run could not go on (a component died unasked, a wait timed out)."""


def tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def log_events(path: Path | None, event: str) -> list[dict]:
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and item.get("event") == event:
            out.append(item)
    return out


# -- reading the log ---------------------------------------------------------------------------

def logged_steps(kafka: KafkaConfig) -> int:
    """Steps in the train-step log (committed entries only)."""
    from trainer.steplog import read_step_log

    return len(asyncio.run(read_step_log(kafka)))


def decoded(kafka: KafkaConfig, short: str) -> list:
    """The events of a topic that decode (the injected garbage is skipped)."""
    return [event for _, event in decoded_records(kafka, short)]


def decoded_records(kafka: KafkaConfig, short: str) -> list:
    from bus.reader import read_topic_records

    out = []
    for rec in asyncio.run(read_topic_records(kafka, kafka.topic_prefix + short)):
        try:
            out.append((rec, codec.decode(rec.value, rec.headers)))
        except codec.DecodeFailure:
            continue
    return out


def weight_versions(kafka: KafkaConfig) -> list:
    from schemas import WeightVersion

    return [e for e in decoded(kafka, "weights") if isinstance(e, WeightVersion)]


def latest_heartbeats(kafka: KafkaConfig) -> dict:
    from schemas import Heartbeat

    return {e.replica_id: e for e in decoded(kafka, "health") if isinstance(e, Heartbeat)}


def wait_for(what: str, check, timeout: float, stack: Stack, poll: float = 2.0):
    deadline = time.monotonic() + timeout
    error = ""
    while True:
        stack.check_alive()
        try:
            value = check()
        except Exception as exc:  # the driver's own reader met a broker just killed: ask again
            value, error = None, f"; last read error: {type(exc).__name__}: {exc}"
        if value:
            return value
        if time.monotonic() > deadline:
            raise ChaosError(f"timed out after {timeout:.0f} s waiting for {what}{error}")
        time.sleep(poll)


# -- faults ------------------------------------------------------------------------------------

@dataclass
class FaultRow:
    fault: str
    detail: str = ""
    steps_before: int = 0
    steps_after: int = 0
    recovery_s: float = 0.0
    ok: bool = False


@dataclass
class Injected:
    """What the driver put into the log and got acknowledged (acks=all)."""

    garbage: dict[str, list[tuple[int, int, bytes]]] = field(default_factory=dict)  # topic -> (partition, offset, value)
    zombie_exit: int | None = None
    zombie_log: Path | None = None
    zombie_pid: int | None = None
    zombie_mode: str = ""  # where it was frozen
    zombie_woken_at: float = 0.0  # time.time() of the SIGCONT
    zombie_log_offset: int = 0  # bytes of its log written before it woke
    zombie_checkpoints: list[str] = field(default_factory=list)  # checkpoint folders it wrote after waking
    zombie_leftovers: list[str] = field(default_factory=list)  # temporary folders of it left behind


class Chaos:
    def __init__(self, args: argparse.Namespace, stack: Stack, kafka: KafkaConfig, cluster, failpoints: Path) -> None:
        self.args = args
        self.stack = stack
        self.kafka = kafka
        self.cluster = cluster
        self.failpoints = failpoints
        self.rng = random.Random(args.seed)
        self.injected = Injected()
        self.rows: list[FaultRow] = []

    def progress(self, row: FaultRow, started: float) -> None:
        """Wait for ``--progress-steps`` steps beyond ``row.steps_before``."""
        want = row.steps_before + self.args.progress_steps
        row.steps_after = wait_for(f"step {want} after fault {row.fault}",
                                   lambda: (n := logged_steps(self.kafka)) >= want and n,
                                   self.args.fault_timeout, self.stack)
        row.recovery_s = time.monotonic() - started
        row.ok = True

    def run(self, name: str) -> FaultRow:
        row = FaultRow(name, steps_before=logged_steps(self.kafka))
        started = time.monotonic()
        print(f"[{time.strftime('%H:%M:%S')}] fault {name} at step {row.steps_before}", flush=True)
        getattr(self, "fault_" + name.replace("-", "_"))(row)
        self.progress(row, started)
        print(f"[{time.strftime('%H:%M:%S')}]   {row.detail}; step {row.steps_after} after "
              f"{row.recovery_s:.0f} s", flush=True)
        self.rows.append(row)
        return row

    # Each fault leaves the stack running again; run() then waits for progress.
    def fault_garbage(self, row: FaultRow) -> None:
        from aiokafka import AIOKafkaProducer

        rng = random.Random(self.args.seed + 1)

        async def produce() -> None:
            producer = AIOKafkaProducer(bootstrap_servers=self.kafka.bootstrap_servers, acks="all",
                                        enable_idempotence=True, **client_security(self.kafka))
            await producer.start()
            try:
                for short in TOPICS:
                    topic = self.kafka.topic_prefix + short
                    for i in range(GARBAGE_PER_TOPIC):
                        value = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
                        # A key: health is compacted (no null keys), and keys spread partitions.
                        meta = await producer.send_and_wait(topic, value, key=f"chaos-garbage-{i}".encode())
                        self.injected.garbage.setdefault(short, []).append((meta.partition, meta.offset, value))
            finally:
                await producer.stop()

        asyncio.run(produce())
        row.detail = f"{GARBAGE_PER_TOPIC} undecodable records into each of {len(TOPICS)} topics"

    def fault_sampler(self, row: FaultRow) -> None:
        name = self.rng.choice([n for n in self.stack.components if n.startswith("sampler")])
        self.stack.kill(name)
        time.sleep(self.rng.uniform(1.0, 3.0))
        self.stack.start(name)
        row.detail = f"SIGKILL {name}; restarted"

    def fault_weights_store(self, row: FaultRow) -> None:
        """A sampler restarts on a damaged store. The trainer is frozen meanwhile so no
        new keyframe lets the replica around the damage (with versions moving on, a
        replica that takes 20 s to start would load the next keyframe whole and never
        meet it); woken, the trainer must see the replica's failed updates in its
        heartbeats and publish a keyframe it can load."""
        samplers = [n for n in self.stack.components if n.startswith("sampler")]
        name = self.rng.choice(samplers)
        # The fault is one replica meeting a damaged store while the others keep training
        # going (the trainer's keyframe needs a new step). Right after a sampler fault the
        # other replica may still be starting: damaged then, it would meet the damage too,
        # no replica could produce a fresh sample, and training would stall until the
        # publisher's keyframe repair (syncer.keyframe_repair_after_s; seed 3, issue #30).
        # This fault is one replica's, so wait until the others serve a recent version.
        others = [n for n in samplers if n != name]
        wait_for(f"{', '.join(others)} serving a recent version before the store is damaged",
                 lambda: replicas_current(self.kafka, others), self.args.fault_timeout, self.stack)
        self.stack.kill(name)
        self.stack.signal("trainer", signal.SIGSTOP)
        try:
            time.sleep(1.0)  # a publish in flight is frozen too; the damage targets what was announced
            newest = max(v.version for v in weight_versions(self.kafka))
            damaged = damage_every_path(self.stack.work / "weights" / MODEL_NAME, newest, self.rng)
            self.stack.start(name)
            comp = self.stack.components[name]
            failed = wait_for(f"{name} to fail an update on the damaged store",
                              lambda: log_events(comp.log, "weight update failed; keeping current weights"),
                              self.args.fault_timeout, self.stack, poll=0.5)
        finally:
            self.stack.signal("trainer", signal.SIGCONT)
        row.detail = (f"SIGKILL {name}, SIGSTOP trainer at v{newest}; {damaged}; {name} restarted: "
                      f"'{failed[0].get('event')}' ({str(failed[0].get('error', ''))[:80]}); SIGCONT trainer")

    def _trainer_at_failpoint(self, row: FaultRow, point: str) -> None:
        comp = self.stack.components["trainer"]
        self.failpoints.write_text(point + "\n")
        try:
            wait_for(f"the trainer at failpoint {point}",
                     lambda: any(e.get("failpoint") == point for e in log_events(comp.log, "failpoint reached")),
                     self.args.fault_timeout, self.stack, poll=0.5)
        finally:
            self.failpoints.write_text("")
        self.stack.kill("trainer")
        self.stack.start("trainer")
        row.detail = f"SIGKILL trainer at {point}; restarted"

    def fault_trainer_checkpoint(self, row: FaultRow) -> None:
        self._trainer_at_failpoint(row, "checkpoint.before_rename")

    def fault_trainer_publish(self, row: FaultRow) -> None:
        self._trainer_at_failpoint(row, "weights.before_announce")

    def fault_trainer_freeze(self, row: FaultRow) -> None:
        inj = self.injected
        comp = self.stack.components["trainer"]
        inj.zombie_mode = self.rng.choice(["in a checkpoint write", "anywhere"])
        if inj.zombie_mode == "in a checkpoint write":
            point = "checkpoint.before_rename"
            self.failpoints.write_text(f"{point}:pause\n")
            wait_for(f"the trainer paused at {point}",
                     lambda: any(e.get("failpoint") == point for e in log_events(comp.log, "failpoint reached")),
                     self.args.fault_timeout, self.stack, poll=0.2)
        self.stack.signal("trainer", signal.SIGSTOP)
        # Disarmed before anything else starts: the replacement writes normally, and the
        # zombie's paused write goes on when it wakes.
        self.failpoints.write_text("")
        zombie_log = comp.log
        zombie = self.stack.retire("trainer")
        inj.zombie_pid = zombie.pid
        frozen_at = logged_steps(self.kafka)
        self.stack.start("trainer")
        wait_for("the replacement trainer to log steps", lambda: logged_steps(self.kafka) >= frozen_at + 2,
                 self.args.fault_timeout, self.stack)
        inj.zombie_log_offset = zombie_log.stat().st_size if zombie_log.exists() else 0
        inj.zombie_woken_at = time.time()
        zombie.send_signal(signal.SIGCONT)
        try:
            inj.zombie_exit = zombie.wait(self.args.fault_timeout)
        except subprocess.TimeoutExpired:
            zombie.kill()
            inj.zombie_exit = zombie.wait(30)
        inj.zombie_log = zombie_log
        inj.zombie_checkpoints, inj.zombie_leftovers = zombie_writes(self.stack.work / "checkpoints", zombie.pid,
                                                                     inj.zombie_woken_at)
        row.detail = (f"SIGSTOP trainer {inj.zombie_mode}, replacement trained, SIGCONT: old one exited "
                      f"{inj.zombie_exit}")

    def fault_sandbox(self, row: FaultRow) -> None:
        self.stack.kill("sandbox")
        time.sleep(self.rng.uniform(1.0, 4.0))  # samplers meet a refused connection meanwhile
        self.stack.start("sandbox")
        row.detail = "SIGKILL sandbox; restarted"

    def fault_feeder(self, row: FaultRow) -> None:
        self.stack.kill("feeder")
        time.sleep(self.rng.uniform(1.0, 3.0))
        self.stack.start("feeder")
        row.detail = "SIGKILL feeder; restarted"

    def fault_broker(self, row: FaultRow) -> None:
        from rollway.broker import pid_alive

        node = self.rng.choice(self.cluster.state.nodes)
        os.kill(node.pid, signal.SIGKILL)
        wait_for("the broker to die", lambda: not pid_alive(node.pid), 30, self.stack, poll=0.2)
        # Train on with two brokers (min.insync.replicas 2), then bring it back.
        before = row.steps_before
        wait_for("steps with one broker down", lambda: logged_steps(self.kafka) >= before + 1,
                 self.args.fault_timeout, self.stack)
        self.cluster.restart_node(node.node_id, timeout=180)
        row.detail = f"SIGKILL broker {node.node_id}; trained on two; restarted"


def replicas_current(kafka: KafkaConfig, names: list[str], behind: int = 2) -> bool:
    """Every replica in ``names`` reports serving a version at most ``behind`` versions
    older than the newest announced one."""
    versions = weight_versions(kafka)
    if not versions:
        return False
    newest = max(v.version for v in versions)
    beats = latest_heartbeats(kafka)
    return all(beats.get(n) is not None and beats[n].status == "serving" and beats[n].weight_version >= newest - behind
               for n in names)


def zombie_writes(checkpoints: Path, pid: int, woken_at: float) -> tuple[list[str], list[str]]:
    """Checkpoint folders the process ``pid`` wrote after ``woken_at`` (their meta.json
    names the writer's pid), and temporary folders of it still there."""
    written, leftovers = [], []
    for child in checkpoints.iterdir() if checkpoints.is_dir() else ():
        meta = child / "meta.json"
        if (".tmp-" in child.name or ".old-" in child.name) and f"-{pid}-" in child.name:
            leftovers.append(child.name)
        elif meta.exists():
            try:
                m = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue
            if m.get("pid") == pid and float(m.get("created_at", 0)) >= woken_at:
                written.append(child.name)
    return written, leftovers


def zombie_events_after_waking(inj: "Injected") -> list[str]:
    """Events of the woken trainer's log that wrote something: a step, a checkpoint,
    weights, dropped groups."""
    if inj.zombie_log is None or not inj.zombie_log.exists():
        return []
    with open(inj.zombie_log, "rb") as f:
        f.seek(inj.zombie_log_offset)
        text = f.read().decode(errors="replace")
    writes = {"train step", "checkpoint written", "weights published", "dropped groups logged"}
    out = []
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and item.get("event") in writes:
            out.append(f"{item['event']} (step {item.get('step', item.get('version', '?'))})")
    return out


def damage_every_path(root: Path, newest: int, rng: random.Random) -> str:
    """Flip a byte in a chunk of the newest keyframe at or before ``newest`` and truncate
    ``newest``'s delta manifest: every path to ``newest`` (that keyframe and the deltas
    after it, or an older keyframe and the deltas up to ``newest``) meets one of them."""
    fulls = sorted(int(p.name[1:13]) for p in (root / "manifests").glob("v*-full.json"))
    keyframe = max(v for v in fulls if v <= newest)
    chunks = sorted(p for p in (root / "chunks").glob(f"v{keyframe:012d}-full/**/*") if p.is_file())
    chunk = rng.choice(chunks)
    data = bytearray(chunk.read_bytes())
    data[rng.randrange(len(data))] ^= 0xFF
    chunk.write_bytes(bytes(data))
    manifest = root / "manifests" / f"v{newest:012d}-delta.json"
    text = manifest.read_bytes()
    manifest.write_bytes(text[: len(text) // 2])
    return (f"flipped a byte of {chunk.relative_to(root)}, truncated {manifest.relative_to(root)} "
            f"to {len(text) // 2} of {len(text)} bytes")


# -- acknowledged writes through the whole run -------------------------------------------------

class Canary:
    """Publishes a ``Metrics`` event every ``interval`` seconds (acks=all) from its own
    thread for the whole run, faults included, and keeps where each acknowledged one
    landed: the audit reads every one back."""

    def __init__(self, kafka: KafkaConfig, interval: float = 0.5) -> None:
        import threading

        self.kafka = kafka
        self.interval = interval
        self.acked: list[tuple[int, int, bytes]] = []  # partition, offset, value
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="canary", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    async def _run(self) -> None:
        from aiokafka import AIOKafkaProducer

        from schemas import Metrics

        producer = AIOKafkaProducer(bootstrap_servers=self.kafka.bootstrap_servers, acks="all",
                                    enable_idempotence=True, request_timeout_ms=10_000,
                                    **client_security(self.kafka))
        await producer.start()
        topic = self.kafka.topic_prefix + "metrics"
        seq = 0
        try:
            while not self._stop.is_set():
                value, headers = codec.encode(Metrics(source="chaos-canary", step=seq, values={"seq": float(seq)},
                                                      created_at=time.time()))
                try:
                    meta = await producer.send_and_wait(topic, value, key=b"chaos-canary", headers=headers)
                    self.acked.append((meta.partition, meta.offset, value))
                except Exception:  # not acknowledged (a broker just died): promises nothing
                    self.failed += 1
                seq += 1
                await asyncio.sleep(self.interval)
        finally:
            await producer.stop()


# -- drain and audit ---------------------------------------------------------------------------

@dataclass
class Invariant:
    name: str
    ok: bool
    detail: str


def drain(stack: Stack, kafka: KafkaConfig, timeout: float) -> tuple[object, float]:
    """Stop the feeder, then wait until every issued group has ended (or ``timeout``)."""
    from trainer.audit import audit_groups

    started = time.monotonic()
    stack.signal("feeder", signal.SIGTERM)
    stack.retire("feeder").wait(60)
    result = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack.check_alive()
        result = asyncio.run(audit_groups(kafka))
        if not result.unaccounted:
            break
        time.sleep(3)
    return result, time.monotonic() - started


def samplers_settled(kafka: KafkaConfig, names: list[str]):
    """(newest announced version, {replica: heartbeat}) once every sampler reports it with
    the announced hash; None before."""
    versions = weight_versions(kafka)
    if not versions:
        return None
    newest = max(versions, key=lambda v: v.version)
    beats = latest_heartbeats(kafka)
    mine = {n: beats.get(n) for n in names}
    if all(b is not None and b.weight_version == newest.version
           and b.details.get("weights_hash") == newest.weights_hash for b in mine.values()):
        return newest, mine
    return None


def read_records(kafka: KafkaConfig, short: str) -> dict[tuple[int, int], object]:
    from bus.reader import read_topic_records

    records = asyncio.run(read_topic_records(kafka, kafka.topic_prefix + short))
    return {(r.partition, r.offset): r for r in records}


def audit(args, stack: Stack, kafka: KafkaConfig, chaos: Chaos, canary: Canary, group_audit, drained_s: float,
          settled, stop_codes: dict) -> list[Invariant]:
    from schemas import DeadLetter
    from trainer.steplog import read_step_log

    out: list[Invariant] = []

    # 1. Every logged step re-executes to its logged hash.
    steps = asyncio.run(read_step_log(kafka))
    replay = subprocess.run([sys.executable, "-m", "rollway.cli", "--config", str(stack.config), "replay",
                             "--from-step", "1", "--verify", "--no-checkpoint", "--json"],
                            cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=1200)
    rows = [json.loads(line) for line in replay.stdout.splitlines() if line.startswith("{")]
    matched = sum(1 for r in rows if r["match"])
    out.append(Invariant("every TrainStep re-executes to its hash (rollway replay --verify, all steps)",
                         replay.returncode == 0 and matched == len(steps) > 0,
                         f"{matched}/{len(steps)} steps match, exit {replay.returncode}"
                         + (f": {replay.stderr.strip()[-300:]}" if replay.returncode else "")))

    # 2. Nothing trained twice; every issued group ended, trained or dropped with a reason.
    trajectories = [t.trajectory_id for s in steps.values() for t in s.event.trajectories]
    twice = len(trajectories) - len(set(trajectories))
    out.append(Invariant("no trajectory trained twice", twice == 0,
                         f"{len(trajectories)} trained, {twice} twice"))
    ga = group_audit
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(ga.dropped.items())) or "none"
    out.append(Invariant("no group ended twice (rollway audit)", not ga.ended_twice and not ga.not_issued,
                         f"{len(ga.ended_twice)} ended twice, {len(ga.not_issued)} ended but never issued"))
    out.append(Invariant("every issued group trained or dropped with a reason (rollway audit)",
                         not ga.unaccounted,
                         f"issued {ga.issued}: trained {ga.trained}, dropped {dropped}, dead-lettered "
                         f"{ga.dead_lettered}, unaccounted {len(ga.unaccounted)} (drain {drained_s:.0f} s)"))

    # 3. Every acknowledged write is still in the log, byte for byte.
    metrics = read_records(kafka, "metrics")
    lost = [(p, o) for p, o, v in canary.acked if getattr(metrics.get((p, o)), "value", None) != v]
    garbage_lost = []
    for short, items in chaos.injected.garbage.items():
        records = metrics if short == "metrics" else read_records(kafka, short)
        garbage_lost += [(short, p, o) for p, o, v in items if getattr(records.get((p, o)), "value", None) != v]
    out.append(Invariant("every acknowledged event still in the log",
                         not lost and not garbage_lost and len(canary.acked) > 0,
                         f"{len(canary.acked)} canaries acked ({canary.failed} not acked), {len(lost)} missing; "
                         f"{sum(map(len, chaos.injected.garbage.values()))} garbage records acked, "
                         f"{len(garbage_lost)} missing; every record a step names was re-read by the replay"))

    # 4. The dead-letter topic holds exactly the injected garbage.
    injected = {(short, p, o) for short, items in chaos.injected.garbage.items() for p, o, _ in items}
    prefix = kafka.topic_prefix
    sources: dict[tuple[str, int, int], int] = {}
    undecodable = set()
    for (p, o), rec in read_records(kafka, "dlq").items():
        try:
            letter = codec.decode(rec.value, rec.headers, DeadLetter)
        except codec.DecodeFailure:
            undecodable.add(("dlq", p, o))
            continue
        key = (letter.topic.removeprefix(prefix), letter.partition, letter.offset)
        sources[key] = sources.get(key, 0) + 1
    foreign = sorted(k for k in sources if k not in injected)
    expected = {k for k in injected if k[0] in DEAD_LETTERED_TOPICS}
    missing = sorted(expected - set(sources))
    dlq_garbage = {k for k in injected if k[0] == "dlq"}
    repeats = sum(n - 1 for n in sources.values())
    per_topic = []
    for short in TOPICS:
        n = sum(1 for k in injected if k[0] == short)
        got = sum(1 for k in sources if k[0] == short and k in injected)
        per_topic.append(f"{short} {got}/{n}" + ("" if short in DEAD_LETTERED_TOPICS else "*"))
    out.append(Invariant("dead-letter topic holds exactly the injected garbage",
                         not foreign and not missing and undecodable == dlq_garbage,
                         f"dead-lettered/injected per topic: {', '.join(per_topic)} (* no dead-lettering "
                         f"reader: kept in the log); {len(foreign)} real records dead-lettered {foreign[:3]}; "
                         f"{len(missing)} garbage not dead-lettered {missing[:3]}; {repeats} repeated letters "
                         f"(same source, deduplicated)"))

    # 5. Samplers end on the newest version with the announced hash.
    if settled:
        newest, beats = settled
        detail = f"v{newest.version} {newest.weights_hash[:12]} on " + ", ".join(
            f"{n} (updates {b.updates_applied}, weight failures {b.details.get('weight_failures')})"
            for n, b in beats.items())
    else:
        detail = "samplers did not report the newest version with its hash"
    out.append(Invariant("samplers end on the newest version with the announced hash", bool(settled), detail))

    # 6. Training progressed after every fault; the frozen trainer was fenced.
    done = [r for r in chaos.rows if r.ok]
    out.append(Invariant("training progressed after every fault",
                         len(done) == len(args.schedule) and all(r.steps_after > r.steps_before for r in done),
                         f"{len(done)}/{len(args.schedule)} faults followed by new steps"))
    if "trainer-freeze" in args.schedule:
        inj = chaos.injected
        fenced_lines = [e for e in log_events(inj.zombie_log, "trainer stopped: not the only writer")]
        wrote = zombie_events_after_waking(inj) + [f"checkpoint {n}" for n in inj.zombie_checkpoints]
        wrote += [f"left {n}" for n in inj.zombie_leftovers]
        fenced = inj.zombie_exit == 4 and bool(fenced_lines) and not wrote
        out.append(Invariant("the woken trainer was fenced (exit 4, nothing written)", fenced,
                             f"frozen {inj.zombie_mode}; exit {inj.zombie_exit}; "
                             + (fenced_lines[0].get("error", "").split(";")[0] if fenced_lines else "no fenced line")
                             + f"; written after waking: {', '.join(wrote) or 'nothing'}"
                             # how it ended instead: the log is gone with a test's temporary directory
                             + ("" if fenced else f"; its log ends:\n{tail(inj.zombie_log, 25)}")))
    out.append(Invariant("every component stops cleanly on SIGTERM (exit 0)",
                         all(c == 0 for c in stop_codes.values()),
                         ", ".join(f"{n} {c}" for n, c in stop_codes.items())))
    return out


def print_tables(args, chaos: Chaos, invariants: list[Invariant], load_before: str, elapsed: float) -> None:
    print(f"\nchaos run: seed {args.seed}, schedule {' '.join(args.schedule)}; {elapsed:.0f} s; "
          f"CPU {cpu_name()}, {os.cpu_count()} cores; load average before {load_before}, "
          f"after {load_average()}")
    print("\n| fault | what happened | steps before -> after | recovery s |")
    print("|---|---|---|---|")
    for r in chaos.rows:
        print(f"| {r.fault} | {r.detail} | {r.steps_before} -> {r.steps_after} | {r.recovery_s:.0f} |")
    print("\n| invariant | holds | detail |")
    print("|---|---|---|")
    for inv in invariants:
        print(f"| {inv.name} | {'yes' if inv.ok else 'NO'} | {inv.detail} |")
    print(f"\n{sum(i.ok for i in invariants)}/{len(invariants)} invariants hold", flush=True)


@dataclass
class SeedResult:
    seed: int
    schedule: list[str]
    code: int
    held: int = 0
    invariants: int = 0
    faults_done: int = 0
    freeze: str = ""  # where the trainer was frozen, and how the woken one exited
    elapsed_s: float = 0.0
    work: str = ""


def main(args: argparse.Namespace) -> int:
    """Every seed of ``args.seeds`` in a row (a fresh cluster and stack each); exit 0
    only when every run held every invariant."""
    results = []
    for seed in args.seeds:
        one = argparse.Namespace(**{**vars(args), "seed": seed, "schedule": schedule_for(args, seed)})
        if args.work_dir and len(args.seeds) > 1:
            one.work_dir = str(Path(args.work_dir) / f"seed-{seed}")
        results.append(run_seed(one))
    if len(results) > 1:
        print(f"\nchaos summary: {len(results)} seeds; CPU {cpu_name()}, {os.cpu_count()} cores; load average "
              f"now {load_average()}")
        print("\n| seed | schedule | invariants hold | faults followed by steps | trainer-freeze | s |")
        print("|---|---|---|---|---|---|")
        for r in results:
            print(f"| {r.seed} | {' '.join(r.schedule)} | {r.held}/{r.invariants} | {r.faults_done}/{len(r.schedule)} "
                  f"| {r.freeze or '-'} | {r.elapsed_s:.0f} |")
        ok = [r.seed for r in results if r.code == 0]
        print(f"\n{len(ok)}/{len(results)} seeds held every invariant"
              + (f"; failed: {[r.seed for r in results if r.code != 0]}" if len(ok) < len(results) else ""),
              flush=True)
    return 0 if all(r.code == 0 for r in results) else 1


def run_seed(args: argparse.Namespace) -> SeedResult:
    result = SeedResult(args.seed, list(args.schedule), 1)
    started = time.monotonic()
    try:
        result.code = _run_seed(args, result)
    finally:
        result.elapsed_s = time.monotonic() - started
    return result


def _run_seed(args: argparse.Namespace, result: SeedResult) -> int:
    from bus import ensure_topics
    from rollway.broker import LocalKafka, free_ports
    from rollway.logging import configure_logging
    from sampler.tiny_model import tiny_model_dir

    # The driver's own readers meet the injected garbage on every read: errors only.
    configure_logging("chaos", level="critical")

    load_before = load_average()
    t0 = time.monotonic()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rollway-chaos-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    result.work = str(work)
    print(f"chaos run, seed {args.seed}, in {work} (logs in {work}/logs)", flush=True)
    cluster = LocalKafka(work / "kafka", nodes=3, heap=args.broker_heap, secure=args.secure)
    stack: Stack | None = None
    canary: Canary | None = None
    try:
        bootstrap = cluster.start(timeout=240)
        prefix = f"chaos{uuid.uuid4().hex[:6]}."
        config = work / "rollway.toml"
        config.write_text(stack_config(work, prefix, tiny_model_dir(), free_ports(1)[0], args.seed))
        from rollway.config import load_config

        whole = load_config(str(config), environ={})
        kafka = whole.kafka
        kafka.bootstrap_servers = bootstrap
        secured_env: dict[str, str] = {}
        if args.secure:
            # The driver (garbage, canary, audit reads) is the operator; every component
            # authenticates as its own role from the credentials file (COMMAND_ROLES), the
            # sandbox API checks tokens; the table is applied as `rollway broker start` does.
            from rollway.commands.acl import secure_setup

            kafka.credentials_file, kafka.role = cluster.state.credentials_file, "admin"
            _, rules = secure_setup(whole)
            print(f"secured cluster: SASL/SCRAM + ACLs, {len(rules)} ACLs for {prefix}*", flush=True)
            secured_env = {"ROLLWAY_KAFKA__CREDENTIALS_FILE": cluster.state.credentials_file}
        else:
            asyncio.run(ensure_topics(kafka))
        failpoints = work / "failpoints"
        failpoints.write_text("")
        stack = Stack(work, config, bootstrap)
        stack.env.update(secured_env)
        stack.add("sandbox", ["sandbox"])
        stack.add("trainer", ["trainer"], {"ROLLWAY_FAILPOINTS": f"@{failpoints}"})
        for i in range(2):
            stack.add(f"sampler-{i}", ["sampler"])
        stack.add("feeder", ["feeder"])
        for name in stack.components:
            stack.start(name)
        canary = Canary(kafka)
        canary.start()
        chaos = Chaos(args, stack, kafka, cluster, failpoints)
        wait_for(f"{args.warmup_steps} steps before the first fault",
                 lambda: logged_steps(kafka) >= args.warmup_steps, args.fault_timeout * 2, stack)
        for name in args.schedule:
            try:
                chaos.run(name)
            except ChaosError as exc:  # audit what there is: the table says which fault failed
                print(f"fault {name} failed: {exc}", flush=True)
                chaos.rows.append(FaultRow(name, detail=f"FAILED: {str(exc)[:300]}"))
                break
        group_audit, drained_s = drain(stack, kafka, args.drain_timeout)
        samplers = [n for n in stack.components if n.startswith("sampler")]
        try:
            settled = wait_for("samplers on the newest version", lambda: samplers_settled(kafka, samplers),
                               args.fault_timeout, stack)
        except ChaosError as exc:
            print(exc, flush=True)
            settled = None
        canary.stop()
        stop_codes = stack.stop_all()
        invariants = audit(args, stack, kafka, chaos, canary, group_audit, drained_s, settled, stop_codes)
        print_tables(args, chaos, invariants, load_before, time.monotonic() - t0)
        result.held, result.invariants = sum(i.ok for i in invariants), len(invariants)
        result.faults_done = sum(1 for r in chaos.rows if r.ok)
        if "trainer-freeze" in args.schedule:
            result.freeze = f"frozen {chaos.injected.zombie_mode}, exit {chaos.injected.zombie_exit}"
        return 0 if all(i.ok for i in invariants) else 1
    except ChaosError as exc:
        print(f"chaos run failed: {exc}", flush=True)
        return 1
    finally:
        if canary is not None:
            canary.stop()
        if stack is not None:
            stack.kill_everything()
        cluster.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help=f"the test suite's schedule: {' '.join(SHORT_SCHEDULE)}")
    p.add_argument("--schedule", help="comma-separated faults (default: all, shuffled after garbage)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", help="run several seeds in a row: N (seeds 0..N-1) or a comma-separated list")
    p.add_argument("--work-dir", help="keep everything here (default: a new temp folder)")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--progress-steps", type=int, default=2, help="new steps that count as progress after a fault")
    p.add_argument("--fault-timeout", type=float, default=240.0, help="seconds for each wait")
    p.add_argument("--drain-timeout", type=float, default=180.0)
    p.add_argument("--broker-heap", default="384m")
    p.add_argument("--secure", action="store_true",
                   help="SASL/SCRAM + ACLs (bus/acl.py's table): each component as its own principal, the "
                        "sandbox API with tokens; the driver injects garbage and reads as admin")
    args = p.parse_args(argv)
    if args.schedule:
        args.schedule = [s.strip() for s in args.schedule.split(",") if s.strip()]
        unknown = set(args.schedule) - set(FULL_SCHEDULE)
        if unknown:
            p.error(f"unknown faults {sorted(unknown)}; known: {FULL_SCHEDULE}")
    args.fixed_schedule = args.schedule
    if args.seeds:
        try:
            items = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            p.error(f"--seeds takes N or a comma-separated list of seeds, not {args.seeds!r}")
        args.seeds = items if "," in args.seeds else list(range(items[0]))
        if not args.seeds:
            p.error("--seeds: no seed to run")
    else:
        args.seeds = [args.seed]
    args.schedule = schedule_for(args, args.seeds[0])
    return args


def schedule_for(args: argparse.Namespace, seed: int) -> list[str]:
    """The faults of one run: ``--schedule`` as given, else garbage first and the rest
    of the full (or ``--short``) schedule shuffled by ``seed``."""
    if args.fixed_schedule:
        return list(args.fixed_schedule)
    base = SHORT_SCHEDULE if args.short else FULL_SCHEDULE
    rest = base[1:]
    random.Random(seed).shuffle(rest)
    return base[:1] + rest


if __name__ == "__main__":
    sys.exit(main(parse_args()))
