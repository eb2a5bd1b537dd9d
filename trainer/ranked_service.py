"""The trainer service on N ranks: one logical trainer, rank 0 its only face to Kafka.

``rollway trainer`` with ``trainer.world_size`` > 1 (or ``--nproc``) launches N ranks
with torch.distributed.run (``rollway/commands/trainer.py``). Then:

* **rank 0** runs the ordinary service (:class:`trainer.service.Trainer`): it alone
  fences, reads the step log, consumes, assembles groups, logs steps in its
  transactions, owns the checkpoint folder and publishes weights. Its core is the
  sharded one (``ShardedTrainCore``); every collective it is about to enter, it first
  announces to the other ranks (:class:`Orders`), with what they need: the step's
  groups and seed, a checkpoint's weights hash.
* **every other rank** (:func:`follow`) holds its shards and waits for orders; it never
  touches Kafka. It trains each step on the groups rank 0 sent, takes part in the DCP
  checkpoint and the publish gather, and exits when rank 0 says stop.

The batch split is ``trainer.distributed.split_groups`` (rule ``SPLIT_RULE``): a pure
function of the groups' token counts, which the step log's records give back exactly,
and of the world size, which the step's training-config hash holds (with the rule's
name, ``trainer.training_config``) and its metrics show (``world_size``). Replay reads a
step's records from the log, so it hands every rank the very groups the live step had,
and the split comes out the same; at another world size the replay refuses with
``ConfigDiffers`` before re-executing anything.

Orders go over a gloo group of their own with a long timeout: a rank waits for the next
step as long as the trainer idles, while the training collectives keep the default
timeout (a stuck collective is an error). A rank that dies takes the trainer down: a
peer blocked on it gets a connection error and exits, and torchrun stops the remaining
ranks (SIGTERM, then SIGKILL) and exits non-zero; ``rollway up``'s supervisor (or
compose's restart policy, or torchrun's own ``--max-restarts``) starts all ranks again,
and the new trainer restores from the last checkpoint and replays the log, as one
process does. A rank whose launcher died (SIGKILLed agent) exits too (:func:`watch_parent`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import structlog

from trainer.service import Trainer
from trainer.sharded_core import ShardedTrainCore

if TYPE_CHECKING:
    from bus.config import KafkaConfig
    from trainer.config import TrainerConfig
    from trainer.core import StepResult
    from trainer.distributed import DistContext
    from trainer.trajectory import Group

log = structlog.get_logger(__name__)

# How long a rank waits for rank 0's next order: the trainer may idle for hours waiting
# for trajectories. (A dead rank 0 is noticed at once: its sockets close.)
ORDERS_TIMEOUT = timedelta(days=30)


class Orders:
    """Rank 0's orders to the other ranks (pickled, broadcast on a gloo group of their
    own; on GPU too, where the training collectives are NCCL's). Created on every rank
    in the same place of the start-up (``new_group`` is collective)."""

    def __init__(self, rank: int) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.group = dist.new_group(backend="gloo", timeout=ORDERS_TIMEOUT)

    def send(self, kind: str, *args: Any) -> None:
        import torch.distributed as dist

        assert self.rank == 0, "only rank 0 gives orders"
        dist.broadcast_object_list([(kind, args)], src=0, group=self.group)

    def receive(self) -> tuple[str, tuple]:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class LeaderCore(ShardedTrainCore):
    """Rank 0's core: announces each step (with its groups and seed) before training it."""

    def __init__(self, cfg: "TrainerConfig", ctx: "DistContext", orders: Orders) -> None:
        super().__init__(cfg, ctx)
        self.orders = orders

    def train_step(self, groups: Sequence["Group"], seed: int | None = None) -> "StepResult":
        self.orders.send("step", list(groups), seed)
        return super().train_step(groups, seed)


class RankedTrainer(Trainer):
    """Rank 0 of an N-rank trainer: the service, its collectives announced to the others."""

    def __init__(self, tcfg: "TrainerConfig", kafka: "KafkaConfig", ctx: "DistContext", orders: Orders,
                 **kw: Any) -> None:
        from trainer.sharded_checkpoint import ShardedCheckpointer

        if ctx.rank != 0:
            raise ValueError("RankedTrainer runs on rank 0 only; the other ranks follow()")
        super().__init__(tcfg, kafka, core=LeaderCore(tcfg, ctx, orders), **kw)
        self.ctx = ctx
        self.orders = orders
        self.checkpointer = ShardedCheckpointer(tcfg.checkpoint_dir, tcfg.keep_checkpoints, rank=0)

    def _restore_checkpoint(self, steps, last: int) -> None:
        from trainer.sharded_checkpoint import restore_newest

        logged = {s: e.event.weights_hash for s, e in steps.items() if s <= last}
        self.orders.send("restore")
        restore_newest(self.core, self.tcfg.checkpoint_dir, logged)

    def _save_checkpoint(self, weights_hash: str) -> None:
        self.orders.send("checkpoint", weights_hash)
        self.checkpointer.save(self.core, weights_hash)

    def _publishable_state(self) -> dict:
        from trainer.sharded_publish import publishable_state_sharded

        self.orders.send("publish")
        state = publishable_state_sharded(self.core.model, self.tcfg.publish_dtype, 0)
        assert state is not None
        return state

    def release_ranks(self) -> None:
        """Tell the other ranks to stop (after this rank's checkpoint writes ended)."""
        try:
            self.orders.send("stop")
        except Exception as exc:  # a rank already gone: torchrun ends the rest
            log.warning("could not tell the other ranks to stop", error=str(exc))


def follow(cfg: "TrainerConfig", ctx: "DistContext", orders: Orders) -> int:
    """A rank other than 0: carry out rank 0's orders until it says stop. Returns 0;
    an order that fails here raises (the rank exits non-zero and torchrun ends the
    trainer), except a checkpoint refusal rank 0 decided and raises itself."""
    from trainer.checkpoint import CheckpointError
    from trainer.checkpoint_owner import CheckpointFenced
    from trainer.sharded_checkpoint import ShardedCheckpointer, restore_newest
    from trainer.sharded_publish import publishable_state_sharded

    core = ShardedTrainCore(cfg, ctx)
    checkpointer = ShardedCheckpointer(cfg.checkpoint_dir, cfg.keep_checkpoints, rank=ctx.rank)
    log.info("rank following rank 0", rank=ctx.rank, world_size=ctx.world_size)
    try:
        while True:
            kind, args = orders.receive()
            if kind == "step":
                groups, seed = args
                core.train_step(groups, seed)
            elif kind == "restore":
                try:
                    restore_newest(core, cfg.checkpoint_dir)  # rank 0's list of checkpoints
                except CheckpointError as exc:  # rank 0 raises the same and stops the trainer
                    log.error("restore failed; waiting for rank 0 to stop", rank=ctx.rank, error=str(exc))
            elif kind == "checkpoint":
                try:
                    checkpointer.save(core, args[0])
                except (CheckpointError, CheckpointFenced) as exc:  # rank 0's decision, raised there too
                    log.error("checkpoint refused; waiting for rank 0 to stop", rank=ctx.rank, error=str(exc))
            elif kind == "publish":
                publishable_state_sharded(core.model, cfg.publish_dtype, ctx.rank)
            elif kind == "stop":
                log.info("rank stopping", rank=ctx.rank, step=core.step)
                return 0
            else:
                raise RuntimeError(f"rank {ctx.rank}: unknown order {kind!r} from rank 0")
    finally:
        try:
            checkpointer.close()  # rank 0's rename waits for this rank's shards
        except Exception as exc:
            log.warning("checkpoint write in flight ended with an error", rank=ctx.rank, error=str(exc))


def ignore_stop_signals() -> None:
    """Ranks other than 0 stop on rank 0's order, not on SIGTERM/SIGINT: torchrun (or
    the supervisor) signals every rank at once, and rank 0's clean stop still needs
    them for the checkpoint write in flight. torchrun SIGKILLs what is left after its
    grace period."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def watch_parent(poll_s: float = 1.0) -> None:
    """Exit when the launcher that started this rank is gone (it was SIGKILLed and
    could not stop the ranks): an orphaned rank must not hold the trainer's shards, or
    rank 0 the consumer group, while a restarted trainer starts."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                log.error("the launcher is gone; exiting", parent=parent)
                os._exit(70)

    threading.Thread(target=watch, name="watch-launcher", daemon=True).start()


class RankedReplay:
    """Rank 0 of ``rollway replay`` at N ranks: a ``LeaderCore`` the replay trains, the
    DCP restore announced to the other ranks, and their release."""

    def __init__(self, cfg: "TrainerConfig", ctx: "DistContext", orders: Orders) -> None:
        from trainer.sharded_checkpoint import ShardedCheckpointer

        self.cfg = cfg
        self.orders = orders
        self.core = LeaderCore(cfg, ctx, orders)
        # Never written to; created because the other ranks create theirs (new_group is
        # collective, and the groups must be made in the same order everywhere).
        self._checkpointer = ShardedCheckpointer(cfg.checkpoint_dir, cfg.keep_checkpoints, rank=0)

    def restore(self, steps, at_most: int) -> int:
        """The newest DCP checkpoint with step <= ``at_most`` the log confirms (older
        ones when it does not load to its hash); 0 = the initial weights."""
        from trainer.sharded_checkpoint import restore_newest

        self.orders.send("restore")
        return restore_newest(self.core, self.cfg.checkpoint_dir,
                              {s: e.event.weights_hash for s, e in steps.items() if s <= at_most})

    def close(self) -> None:
        import torch.distributed as dist

        try:
            self.orders.send("stop")
        except Exception as exc:
            log.warning("could not tell the other ranks to stop", error=str(exc))
        self._checkpointer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def ranked_replay_core(cfg: "TrainerConfig") -> RankedReplay | None:
    """In a rank of ``rollway replay``: rank 0's :class:`RankedReplay`; on the other
    ranks, follow rank 0 until it stops and return None."""
    import torch.distributed as dist

    from trainer.distributed import init_distributed

    watch_parent()
    ctx = init_distributed(cfg.device, cfg.world_size, cpu_offload=cfg.fsdp.cpu_offload)
    orders = Orders(ctx.rank)
    if ctx.is_leader:
        return RankedReplay(cfg, ctx, orders)
    ignore_stop_signals()
    try:
        follow(cfg, ctx, orders)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return None
