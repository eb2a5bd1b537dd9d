"""``rollway acl apply|show``: the bus's users and ACLs (bus/acl.py holds the table).

Also the one place a command's Kafka principal is chosen (:func:`check_principal`, run
by ``load_config_or_exit`` for every command): a component authenticates as its own
role, every other command (tools, ``rollway up``) as admin.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bus.acl import AclNames
    from rollway.config import RollwayConfig

# The role each component command runs as (bus.acl.TABLE); other commands: admin.
COMMAND_ROLES = {
    "trainer": "trainer",
    "sampler": "sampler",
    "sandbox": "grader",
    "feeder": "feeder",
    "evaluator": "evaluator",
    "eval": "evaluator",
    "analytics": "analytics",
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("apply", help="create the missing topics, SCRAM users (from kafka.credentials_file) and "
                                 "ACLs; idempotent, removes nothing")
    show = sub.add_parser("show", help="the ACLs as the broker holds them")
    show.add_argument("--json", action="store_true")
    sub.add_parser("table", help="the table this config asks for (no broker needed)")


def secure_setup(cfg: "RollwayConfig") -> tuple[list[str], list]:
    """As admin: the topics, the users and the ACLs of ``cfg``. Returns the users and
    the ACL rules created (``bus.acl.apply``)."""
    import asyncio

    from bus import acl
    from bus.admin import ensure_topics
    from bus.security import load_credentials

    asyncio.run(ensure_topics(cfg.kafka))
    creds = load_credentials(cfg.kafka.credentials_file) if cfg.kafka.credentials_file else None
    return acl.apply(cfg.kafka, acl_names(cfg), creds)


def acl_names(cfg: "RollwayConfig") -> "AclNames":
    """The names bus.acl's table refers to, from the whole config."""
    from bus.acl import AclNames

    txn = cfg.trainer.transactional_id or f"{cfg.kafka.topic_prefix}{cfg.trainer.group_id}"
    return AclNames(prefix=cfg.kafka.topic_prefix, trainer_group=cfg.trainer.group_id,
                    trainer_transactional_id=txn, sampler_group=cfg.sampler.group_id,
                    evaluator_group=cfg.eval.group_id)


def check_principal(cfg: "RollwayConfig", command: str) -> None:
    """Set this command's role (unless the config names one); for a component on a
    secured bus, check at start that the broker grants what the table says, or exit 3
    with one line naming the principal, the resource and the operation."""
    import sys

    from bus.security import (
        SANDBOX_ROLES, CredentialsError, NotAuthorized, load_credentials, security_protocol, set_identity,
        set_sandbox_token,
    )

    cfg.kafka.role = cfg.kafka.role or COMMAND_ROLES.get(command, "admin")
    set_identity(cfg.kafka)
    tokens_file = cfg.sandbox.tokens_file = cfg.sandbox.tokens_file or cfg.kafka.credentials_file
    if tokens_file and command != "sandbox":
        try:  # the sandbox API token of this role (sandbox/auth.py)
            role = cfg.kafka.role if cfg.kafka.role in SANDBOX_ROLES else "admin"
            set_sandbox_token(load_credentials(tokens_file).sandbox.get(role, ""))
        except CredentialsError as exc:
            print(exc, file=sys.stderr)
            raise SystemExit(3) from None
    if command not in COMMAND_ROLES or security_protocol(cfg.kafka) == "PLAINTEXT":
        return
    from bus.acl import preflight
    from bus.connect import KafkaUnreachable

    try:
        preflight(cfg.kafka, acl_names(cfg))
    except (NotAuthorized, CredentialsError) as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(3) from None
    except KafkaUnreachable:
        pass  # a service waits for its broker (bus.connect); its clients' start checks again


def run(args: argparse.Namespace) -> int:
    import sys

    import msgspec

    from bus import acl
    from bus.security import CredentialsError
    from rollway.commands import load_config_or_exit
    from rollway.logging import configure_logging

    configure_logging("acl", level="warning")
    cfg = load_config_or_exit(args, "acl")
    names = acl_names(cfg)
    if args.action == "table":
        print(acl.format_rules(acl.rules(names, acl.default_users())))
        return 0
    try:
        if args.action == "apply":
            users, new = secure_setup(cfg)
            print(f"users created: {', '.join(users) or 'none'}; ACLs created: {len(new)} "
                  f"(table: {len(acl.rules(names, acl.default_users()))} rules)")
            return 0
        found = acl.show(cfg.kafka)
        print(msgspec.json.encode(found).decode() if args.json else acl.format_rules(found))
        return 0
    except (acl.AclError, CredentialsError) as exc:
        print(f"rollway acl: {exc}", file=sys.stderr)
        return 1
