"""The trainer service on 2 ranks (issue #28): `rollway trainer` at trainer.world_size 2
launches its ranks with torch.distributed.run (gloo on CPU), rank 0 consumes real Kafka
and logs the steps, the other rank trains its share of each batch
(trainer/ranked_service.py). One rank SIGKILLed takes the whole trainer down; the
restarted trainer restores the DCP checkpoint, re-executes the logged steps after it to
their logged hashes and goes on; the step log shows nothing trained twice or lost; and
`rollway replay --verify` on 2 ranks re-executes the whole log bit for bit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import msgspec
import pytest

from rollway.config import RollwayConfig
from tests.cli import REPO, ROLLWAY, run_cli
from tests.synthetic import load_tiny, make_task_groups
from tests.test_trainer_crash import TrainerProcess, publish
from trainer.config import TrainerConfig
from trainer.distributed import SPLIT_RULE
from trainer.steplog import read_step_log
from trainer.training_config import training_config_hash, training_settings

# TrainerConfig()'s hash before trainer.world_size existed (commit f79fc5e): logs written
# by one process keep replaying.
HASH_BEFORE_WORLD_SIZE = "7f4554199ac3191a"


def test_world_size_one_leaves_the_training_config_hash_as_it_was():
    assert "world_size" not in training_settings(TrainerConfig())
    assert training_config_hash(TrainerConfig()) == HASH_BEFORE_WORLD_SIZE
    two = training_settings(TrainerConfig(world_size=2))
    assert (two["world_size"], two["split_rule"]) == (2, SPLIT_RULE)
    assert training_config_hash(TrainerConfig(world_size=2)) != HASH_BEFORE_WORLD_SIZE


def test_the_ranks_command_line_leaves_out_the_launcher_flags_torchrun_would_refuse():
    """torchrun's parser reads the ranks' command line too and refused `--nproc` as an
    ambiguous abbreviation of its --nproc-per-node: `rollway trainer --nproc N` failed
    before any rank started (benchmarks/trainer_multinode.py found it). The ranks get
    the world size from ROLLWAY_TRAINER__WORLD_SIZE instead. No process starts here."""
    from torch.distributed.run import get_args_parser

    from rollway.commands.trainer import rank_argv

    line = ["--config", "r.toml", "trainer", "--no-publish", "--nproc", "1", "--max-steps", "3", "--nnodes", "2",
            "--node-rank=1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29400", "--rdzv-id", "job",
            "--master-addr", "h", "--master-port=1", "--max-restarts", "2"]
    assert rank_argv(line) == ["--config", "r.toml", "trainer", "--no-publish", "--max-steps", "3"]
    launcher = ["--nproc-per-node=1", "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400"]
    parsed = get_args_parser().parse_args([*launcher, "--module", "rollway.cli", *rank_argv(line)])
    assert parsed.training_script_args == rank_argv(line) and parsed.nnodes == "2"
    with pytest.raises(SystemExit):  # the whole line, as before
        get_args_parser().parse_args([*launcher, "--module", "rollway.cli", *line])


RANK_ENDING = """
import runpy, sys, threading
import torch
import rollway.cli
from trainer.distributed import init_distributed

rollway.cli.build_parser()  # the commands' imports, before the thread competes for the GIL
init_distributed("cpu")

def busy():  # retakes the GIL after each op (gloo's workers take it to free a tensor)
    a = torch.ones(1000)
    while True:
        a + a

threading.Thread(target=busy, daemon=True).start()
sys.argv = ["rollway", "config", "show"]
runpy.run_module("rollway.cli", run_name="__main__")
"""


def test_a_rank_ends_without_the_interpreter_teardown_where_torch_threads_abort_it(tmp_path):
    """A rank (here of a 1-rank gloo group) that ends through `rollway.cli` while a torch
    thread still runs exits with the command's code, its output out. Through the
    interpreter teardown (before trainer.distributed.exit_rank) it aborted every time here:
    a thread that retakes the GIL during Py_FinalizeEx is ended with pthread_exit inside a
    noexcept C++ destructor, "terminate called without an active exception", SIGABRT, no
    traceback. In every FSDP rank gloo's worker threads are alive at that teardown (they
    outlive destroy_process_group) and take the GIL when they free a finished
    collective's tensors (pytorch#190489). test_fsdp_muon's rank 1 once died with that
    message under load; that run itself was not reproduced."""
    import socket
    import subprocess
    import sys

    from tests.fsdp_helpers import REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", RANK_ENDING], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert "terminate called" not in proc.stderr
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'model_name = "rollway-tiny"' in proc.stdout  # the command's output got out before the exit


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.kafka
@pytest.mark.slow
async def test_two_rank_trainer_loses_one_rank_restarts_replays_and_loses_nothing(kafka_config, tiny_model_path,
                                                                                  tmp_path):
    model, tok = load_tiny(str(tiny_model_path))
    groups = make_task_groups(model, tok, 10, group_size=2, max_new_tokens=8, env_after=3, seed=7)
    del model
    trainer_cfg = TrainerConfig(
        model_path=str(tiny_model_path), checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3,
        keep_checkpoints=2, groups_per_step=2, max_staleness=1000, learning_rate=1e-3, muon_learning_rate=1e-3,
        num_threads=1, micro_batch_tokens=256, group_id="ranks-trainer", session_timeout_ms=6000, world_size=2,
    )
    config = tmp_path / "rollway.toml"
    config.write_bytes(msgspec.toml.encode(RollwayConfig(kafka=kafka_config, trainer=trainer_cfg)))

    # Run 1: four steps' groups; rank 1 is SIGKILLed once step 4 is logged (checkpoint 3
    # on disk), so the restart has a logged step to re-execute after the checkpoint.
    published = await publish(kafka_config, groups[:8])
    first = TrainerProcess(config, tmp_path / "trainer-1.log")
    first.wait_for(lambda: first.last_step() >= 4
                   and any(e["step"] == 3 for e in first.events("sharded checkpoint written")),
                   240, "4 steps and checkpoint 3")
    ranks = {e["rank"]: e["pid"] for e in first.events("distributed trainer rank up")}
    assert sorted(ranks) == [0, 1] and first.proc.pid not in ranks.values()
    os.kill(ranks[1], signal.SIGKILL)
    code = first.wait(90)  # the whole trainer goes: torchrun stops rank 0 and exits
    assert code != 0, first.log.read_text()[-3000:]
    deadline = time.monotonic() + 10
    while _alive(ranks[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(ranks[0]), "rank 0 outlived its trainer"
    assert first.last_step() == 4

    # Run 2: one more step's groups; the restarted trainer restores checkpoint 3 (DCP,
    # written at 2 ranks), re-executes step 4 to its logged hash, then trains step 5.
    published += await publish(kafka_config, groups[8:])
    second = TrainerProcess(config, tmp_path / "trainer-2.log", "--max-steps", "5")
    assert second.wait(240) == 0, second.log.read_text()[-3000:]
    (restoring,) = second.events("restoring")
    assert (restoring["checkpoint_step"], restoring["logged_steps"]) == (3, 4)
    loaded = second.events("sharded checkpoint loaded")  # one line a rank
    assert [(e["step"], e["written_at_world_size"], e["world_size"]) for e in loaded] == [(3, 2, 2)] * 2
    assert [(e["step"], e["match"]) for e in second.events("replayed step")] == [(4, True)]
    assert [e["step"] for e in second.events("train step")] == [5]
    assert [e["rank"] for e in second.events("rank stopping")] == [1]

    # The step log: steps 1..5, each logged at 2 ranks under the 2-rank config hash, every
    # published trajectory trained exactly once.
    steps = await read_step_log(kafka_config)
    assert sorted(steps) == [1, 2, 3, 4, 5]
    assert {steps[s].event.config_hash for s in steps} == {training_config_hash(trainer_cfg)}
    assert {steps[s].event.metrics["world_size"] for s in steps} == {2.0}
    trained = [t.trajectory_id for s in sorted(steps) for t in steps[s].event.trajectories]
    assert len(trained) == len(set(trained)) == 20
    assert set(trained) == set(published)
    assert [len(steps[s].event.groups) for s in sorted(steps)] == [2] * 5

    # `rollway replay` at trainer.world_size 2 runs on 2 ranks: from the initial model,
    # every logged step (live, replayed, after the restart) re-splits and re-executes to
    # its logged hash.
    result = run_cli("replay", "--from-step", "1", "--to-step", "5", "--verify", "--no-checkpoint", "--json",
                     config=config, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"step"')]
    assert [(r["step"], r["match"]) for r in rows] == [(s, True) for s in range(1, 6)]
    assert rows[-1]["replayed_hash"] == steps[5].event.weights_hash

    # The same replay across two "machines" (#28): two launchers, one rank each, a static
    # rendezvous on this host; rank 0 (node 0) reads the log from Kafka, rank 1 (node 1)
    # follows. Every step re-executes to its logged hash, the rows are the standalone
    # replay's, and node 1 prints none (it only follows).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen([*ROLLWAY, "--config", str(config), "replay", "--from-step", "1", "--to-step", "5",
                               "--verify", "--no-checkpoint", "--json", "--nnodes", "2", "--node-rank", str(i),
                               "--rdzv-endpoint", f"127.0.0.1:{port}"],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    try:
        outs = [node.communicate(timeout=240) for node in nodes]
    finally:  # one launcher that never returned leaves no process behind
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (out, err) in zip(nodes, outs):
        assert node.returncode == 0, out[-2000:] + err[-3000:]
    two = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith('{"step"')]
    assert two == [{**r, "seconds": t["seconds"]} for r, t in zip(rows, two)] and len(two) == 5
    assert not [line for line in outs[1][0].splitlines() if line.startswith('{"step"')]


@pytest.mark.parametrize("command", ["replay", "trainer"])
@pytest.mark.parametrize("flags, says", [
    (["--nnodes", "2", "--node-rank", "0"], "--nnodes 2 needs a rendezvous endpoint: --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1"], "--nnodes 2 with a static rendezvous needs --node-rank"),
    (["--nnodes", "1:2"], "--nnodes 1:2: give a fixed number of machines"),
    (["--nnodes", "3", "--node-rank", "0", "--master-addr", "h"], "trainer.world_size = 2 is not --nnodes 3 x 0"),
])
def test_launcher_flags_that_cannot_make_the_group_are_one_line_exit_2(tmp_path, command, flags, says):
    """`rollway trainer` and `rollway replay` share the launcher flags (rollway/commands/
    launcher.py). A combination torchrun would wait on until its rendezvous timed out
    (no endpoint, or a static rendezvous where every machine is machine 0) is refused
    before any rank starts: one line, exit 2. No process but the command starts."""
    config = tmp_path / "rollway.toml"
    config.write_bytes(msgspec.toml.encode(RollwayConfig(trainer=TrainerConfig(
        checkpoint_dir=str(tmp_path / "ckpt"), world_size=2))))
    extra = ["--from-step", "1", "--no-checkpoint"] if command == "replay" else ["--no-publish"]
    result = run_cli(command, *extra, *flags, config=config, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"rollway {command}: ") and says in result.stderr
