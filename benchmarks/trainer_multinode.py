"""`rollway trainer` across machines with torchrun's standard rendezvous, shown on one host.

Two "machines" are two launcher processes on this host, each

    rollway trainer --nproc 1 --nnodes 2 --node-rank I --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID --max-steps N --no-publish

(one rank each, c10d rendezvous on localhost), against the same trainer on one machine
(`rollway trainer --nproc 2 --max-steps N --no-publish`), each on its own topics holding
the same trajectories (real Kafka: a broker started here, or $KAFKA_BOOTSTRAP_SERVERS).
Both are 2-rank trainers (same batch split, gloo sums of two addends), so the same batch
gives the same weights bits. Which groups make each live step depends on the order
records arrive in, so the check that decides is a re-execution: `rollway replay
--verify` of the two-machine log on one machine (2 ranks, --standalone) must reproduce
every logged hash; the live runs' hashes are compared where their batches are equal.
Also checked:
each launcher ran exactly one rank, the log holds steps 1..N at world size 2 under the
2-rank config hash, and the DCP checkpoint written into the shared folder holds one
shard file a rank.

    flock /tmp/rollway-heavy.lock .venv/bin/python benchmarks/trainer_multinode.py

Prints one JSON line; exit 1 when the hashes differ or a check fails. Costs a broker
start and two 2-rank trainer runs (a few minutes on 2 shared cores): a script, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _uptime() -> str:
    """The load averages (1, 5, 15 min)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _launch(config: Path, log: Path, replica: str, extra: list[str], steps: int) -> subprocess.Popen:
    env = dict(os.environ, ROLLWAY_REPLICA_ID=replica, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    out = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "rollway.cli", "--config", str(config), "trainer", "--no-publish",
                             "--max-steps", str(steps), *extra], cwd=REPO, env=env, stdout=out,
                            stderr=subprocess.STDOUT)


def _events(log: Path, name: str) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == name:
                out.append(event)
    return out


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc, log in zip(procs, logs):
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            raise SystemExit(f"timed out after {timeout} s; log tail of {log}:\n" + log.read_text()[-3000:])
    return codes


async def _prepare(kcfg, groups) -> list[str]:
    from bus import ensure_topics
    from tests.trainer_helpers import publish_trajectories

    await ensure_topics(kcfg)
    return await publish_trajectories(kcfg, [t for g in groups for t in g], chunk_tokens=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--port", type=int, default=29431, help="the c10d rendezvous port on 127.0.0.1")
    parser.add_argument("--work", default="/tmp/rollway-trainer-multinode")
    parser.add_argument("--timeout", type=float, default=240, help="seconds a run may take")
    args = parser.parse_args()

    import msgspec

    from bus.config import KafkaConfig
    from rollway.broker import LocalKafka, external_bootstrap
    from rollway.config import RollwayConfig
    from sampler.tiny_model import tiny_model_dir
    from tests.synthetic import load_tiny, make_task_groups
    from trainer.config import TrainerConfig
    from trainer.steplog import read_step_log
    from trainer.training_config import training_config_hash

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load_before = _uptime()
    kafka = None
    bootstrap = external_bootstrap()
    if not bootstrap:
        kafka = LocalKafka(work / "kafka", nodes=1)
        bootstrap = kafka.start(timeout=120)
    try:
        model_path = str(tiny_model_dir())
        model, tok = load_tiny(model_path)
        groups = make_task_groups(model, tok, args.steps * args.groups_per_step, group_size=2, max_new_tokens=8,
                                  env_after=3, seed=7)
        del model
        run_id = uuid.uuid4().hex[:8]
        configs, kafkas, trainer_cfgs = {}, {}, {}
        for name in ("one_machine", "two_machines"):
            kcfg = KafkaConfig(bootstrap_servers=bootstrap, topic_prefix=f"multinode-{run_id}-{name}.",
                               partitions={"tasks": 2, "trajectories": 2, "rewards": 2, "health": 1, "metrics": 1},
                               client_id="rollway-multinode")
            # One DCP checkpoint, at the last step: every rank writes its shard into the
            # one folder (a shared filesystem across machines; here the same disk).
            tcfg = TrainerConfig(model_path=model_path, checkpoint_dir=str(work / name / "ckpt"),
                                 checkpoint_every=args.steps, groups_per_step=args.groups_per_step,
                                 max_staleness=1000, learning_rate=1e-3, muon_learning_rate=1e-3, num_threads=1,
                                 micro_batch_tokens=256, group_id="multinode-trainer", session_timeout_ms=6000,
                                 world_size=2)
            (work / name).mkdir()
            config = work / name / "rollway.toml"
            config.write_bytes(msgspec.toml.encode(RollwayConfig(kafka=kcfg, trainer=tcfg)))
            asyncio.run(_prepare(kcfg, groups))
            configs[name], kafkas[name], trainer_cfgs[name] = config, kcfg, tcfg

        timings = {}
        # One machine, 2 ranks.
        t0 = time.monotonic()
        log1 = work / "one_machine" / "trainer.log"
        codes1 = _wait([_launch(configs["one_machine"], log1, "one-machine", ["--nproc", "2"], args.steps)],
                       [log1], args.timeout)
        timings["one_machine_s"] = round(time.monotonic() - t0, 1)
        # Two machines of 1 rank each: two launchers, c10d rendezvous on localhost.
        t0 = time.monotonic()
        logs2 = [work / "two_machines" / f"node{i}.log" for i in range(2)]
        procs = [_launch(configs["two_machines"], logs2[i], f"node{i}",
                         ["--nproc", "1", "--nnodes", "2", "--node-rank", str(i), "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"127.0.0.1:{args.port}", "--rdzv-id", f"rollway-{run_id}"],
                         args.steps) for i in range(2)]
        codes2 = _wait(procs, logs2, args.timeout)
        timings["two_machines_s"] = round(time.monotonic() - t0, 1)

        # The two-machine log re-executed by `rollway replay --verify` on one machine, 2 ranks
        # (--standalone): the very batches the two machines trained, the single-node way.
        t0 = time.monotonic()
        replay = subprocess.run([sys.executable, "-m", "rollway.cli", "--config", str(configs["two_machines"]),
                                 "replay", "--from-step", "1", "--to-step", str(args.steps), "--verify",
                                 "--no-checkpoint", "--json"], cwd=REPO, capture_output=True, text=True,
                                timeout=args.timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
        timings["replay_one_machine_s"] = round(time.monotonic() - t0, 1)
        replayed = [json.loads(line) for line in replay.stdout.splitlines() if line.startswith('{"step"')]

        logs = {name: asyncio.run(read_step_log(kafkas[name])) for name in kafkas}
        hashes = {name: [logs[name][s].event.weights_hash for s in sorted(logs[name])] for name in logs}
        # The live runs consumed the same records, but which groups make each step depends
        # on arrival order: their hashes are comparable only where the batches are equal.
        batches = {name: [sorted(t.trajectory_id for t in logs[name][s].event.trajectories) for s in sorted(logs[name])]
                   for name in logs}
        same_batch_steps = [i + 1 for i, (a, b) in enumerate(zip(batches["one_machine"], batches["two_machines"]))
                            if a == b]
        ranks_per_node = [sorted(e["rank"] for e in _events(log, "distributed trainer rank up")) for log in logs2]
        ckpt = work / "two_machines" / "ckpt" / f"step-{args.steps:08d}"
        shard_files = sorted(p.name for p in ckpt.glob("*.distcp")) if ckpt.is_dir() else []
        want_hash = training_config_hash(trainer_cfgs["one_machine"])
        checks = {
            "exit_codes_zero": codes1 == [0] and codes2 == [0, 0],
            "steps_logged": all(sorted(logs[n]) == list(range(1, args.steps + 1)) for n in logs),
            "replay_on_one_machine_matches_every_step": replay.returncode == 0
            and [(r["step"], r["match"]) for r in replayed] == [(s, True) for s in range(1, args.steps + 1)]
            and [r["replayed_hash"] for r in replayed] == hashes["two_machines"],
            "live_runs_equal_where_batches_equal": all(hashes["one_machine"][s - 1] == hashes["two_machines"][s - 1]
                                                       for s in same_batch_steps),
            "one_rank_per_launcher": sorted(r for node in ranks_per_node for r in node) == [0, 1]
            and all(len(node) == 1 for node in ranks_per_node),
            "world_size_2_config_hash": all(logs[n][s].event.config_hash == want_hash
                                            and logs[n][s].event.metrics["world_size"] == 2.0
                                            for n in logs for s in logs[n]),
            "checkpoint_one_shard_a_rank": len(shard_files) == 2,
        }
        summary = {"started": started, "load_before": load_before, "load_after": _uptime(), "steps": args.steps,
                   "groups_per_step": args.groups_per_step, **timings, "exit_codes": {"one_machine": codes1,
                   "two_machines": codes2}, "ranks_per_launcher": ranks_per_node, "checkpoint_files": shard_files,
                   "live_steps_with_equal_batches": same_batch_steps,
                   "hashes": hashes, "checks": checks, "ok": all(checks.values())}
        print(json.dumps(summary))
        if not summary["ok"]:
            for log in [log1, *logs2]:
                print(f"--- {log}\n" + log.read_text()[-2500:], file=sys.stderr)
            print("--- replay\n" + replay.stdout[-1500:] + replay.stderr[-2500:], file=sys.stderr)
        return 0 if summary["ok"] else 1
    finally:
        if kafka is not None:
            kafka.stop()


if __name__ == "__main__":
    raise SystemExit(main())
