"""The ``rollway`` command. Subcommands live in ``rollway.commands.<name>``; each module
has ``configure(parser)`` and ``run(args) -> int`` and keeps heavy imports (torch, vLLM,
aiokafka) inside ``run`` so ``rollway --help`` stays instant."""

from __future__ import annotations

import argparse
import importlib
import sys

# (name, module, one-line help). Add a line here to add a command.
COMMANDS: list[tuple[str, str, str]] = [
    ("up", "rollway.commands.up", "run the main job: the whole stack as supervised local processes, live view"),
    ("broker", "rollway.commands.broker", "start/stop/status a local Apache Kafka (KRaft)"),
    ("config", "rollway.commands.config", "show the effective configuration"),
    ("topics", "rollway.commands.topics", "create topics; list partitions, end offsets and group lag"),
    ("acl", "rollway.commands.acl", "who may write what: apply or show the bus's users and ACLs"),
    ("tail", "rollway.commands.tail", "print decoded events of a topic"),
    ("report", "rollway.commands.report", "PNG plots and a markdown summary of a run, read from the log"),
    ("model", "rollway.commands.model", "build the local tiny model and tokenizer"),
    ("analytics", "rollway.commands.analytics", "example analytics consumers (solve rate)"),
    ("sampler", "rollway.commands.sampler", "run a sampler replica: tasks -> agent rollouts -> trajectory chunks"),
    ("sandbox", "rollway.commands.sandbox", "run the sandbox service: isolated sessions, grading, rewards"),
    ("images", "rollway.commands.images", "pull, list and prune the sandbox host's task images (OCI)"),
    ("feeder", "rollway.commands.feeder", "publish task groups, favouring tasks the policy sometimes solves"),
    ("trainer", "rollway.commands.trainer", "train from trajectories and rewards; restore and replay after a crash"),
    ("replay", "rollway.commands.replay", "re-execute logged train steps and verify their weights hashes"),
    ("audit", "rollway.commands.audit", "does every issued group end trained or dropped exactly once? (from the log)"),
    ("weights", "rollway.commands.weights", "list, verify, export and prune weight versions in the store"),
    ("eval", "rollway.commands.eval", "held-out pass@1 of a weight version (table or --json; EvalResult on rollway.evals)"),
    ("evaluator", "rollway.commands.evaluator", "evaluate every N-th weight version while training runs"),
    ("tasks", "rollway.commands.tasks", "task hygiene: grade each task's reference, untouched repo and adversaries"),
]


# Long-running components: with no broker they wait for one (retrying, one log line
# per attempt); every other command is a tool and exits 1 with one line instead.
SERVICES = frozenset({"trainer", "sampler", "feeder", "sandbox", "evaluator", "analytics"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollway",
        description="Rollway: asynchronous RL for coding agents over Kafka.",
    )
    parser.add_argument("--config", help="TOML config file (default: $ROLLWAY_CONFIG or ./rollway.toml)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module, help_text in COMMANDS:
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.configure(cmd)
        cmd.set_defaults(_module=mod)
    return parser


def main(argv: list[str] | None = None) -> int:
    code = run_command(argv)
    distributed = sys.modules.get("trainer.distributed")
    if distributed is not None and distributed.joined():
        # A trainer or replay rank (whether torchrun runs `-m rollway.cli` or the `rollway`
        # script): end it without the interpreter teardown, where gloo's threads still
        # run (trainer.distributed.exit_rank).
        distributed.exit_rank(code)
    return code


def run_command(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported here, not at the top: bus pulls in aiokafka and `rollway --help` stays instant.
    from bus.connect import KafkaUnreachable, wait_for_broker
    from bus.security import CredentialsError, NotAuthorized, authorization_errors, denied_message

    wait_for_broker(args.command in SERVICES)
    try:
        return int(args._module.run(args) or 0)
    except KafkaUnreachable as exc:
        print(exc, file=sys.stderr)
        return 1
    except (NotAuthorized, CredentialsError) as exc:
        # Wrong credentials or a missing ACL: one line, and no retry (docs/security.md).
        print(exc, file=sys.stderr)
        return 3
    except authorization_errors() as exc:
        print(denied_message(exc), file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
