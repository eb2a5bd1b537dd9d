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
    cred = sub.add_parser("credentials", help="generate the credentials once (random SCRAM passwords, sandbox "
                                              "tokens) and split them per role, for a deployment such as "
                                              "docker-compose.yml: <out-dir>/<role>/credentials.json holds only "
                                              "that role's user and token; <out-dir>/kafka/ the broker's files")
    cred.add_argument("--out-dir", required=True)
    cred.add_argument("--kafka-uid", type=int, default=None,
                      help="owner of <out-dir>/kafka/* (the broker's user: 1000 in the apache/kafka image)")
    cred.add_argument("--listener", default="SASL_PLAINTEXT", help="the broker's SASL listener name")


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


def write_deployment_credentials(out_dir: str, kafka_uid: int | None = None,
                                 listener: str = "SASL_PLAINTEXT") -> tuple[bool, list[str]]:
    """``<out_dir>/admin/credentials.json`` (every secret, generated on the first call,
    kept after), one file per component role with only its own user and token, and the
    broker's files in ``<out_dir>/kafka/``: ``broker.properties`` (SCRAM listener, the
    authorizer, super users; bus/acl's table is applied later by ``rollway acl apply``),
    ``scram-users`` (the admin and broker users, one ``kafka-storage format --add-scram``
    value a line) and ``client.properties`` (the broker's own login, for health checks).
    Every file 0600. Returns (generated now, files written)."""
    from pathlib import Path

    from bus.security import (
        BROKER_USER, KAFKA_ROLES, ensure_credentials, role_credentials, write_credentials,
    )
    from rollway.broker import scram_format_args, secure_broker_properties

    root = Path(out_dir)
    master = root / "admin" / "credentials.json"
    generated = not master.exists()
    creds = ensure_credentials(master)
    written = [str(master)]
    for role in KAFKA_ROLES:
        if role != "admin":
            path = root / role / "credentials.json"
            write_credentials(path, role_credentials(creds, role))
            written.append(str(path))
    kafka = root / "kafka"
    kafka.mkdir(parents=True, exist_ok=True)
    scram = scram_format_args(creds, ("admin", BROKER_USER))[1::2]
    broker = creds.user(BROKER_USER)
    client = {"security.protocol": listener, "sasl.mechanism": "SCRAM-SHA-512",
              "sasl.jaas.config": 'org.apache.kafka.common.security.scram.ScramLoginModule required '
                                  f'username="{broker.username}" password="{broker.password}";'}
    files = {"broker.properties": secure_broker_properties(creds, listener), "client.properties": client}
    for name, props in files.items():
        _write_private(kafka / name, "".join(f"{k}={v}\n" for k, v in props.items()), kafka_uid)
    _write_private(kafka / "scram-users", "".join(f"{line}\n" for line in scram), kafka_uid)
    written += [str(kafka / n) for n in (*files, "scram-users")]
    return generated, written


def _write_private(path, text: str, uid: int | None) -> None:
    import os

    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    if uid is not None:
        os.chown(tmp, uid, -1)
    os.replace(tmp, path)


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
    if args.action == "credentials":  # no config, no broker: files only
        try:
            generated, written = write_deployment_credentials(args.out_dir, args.kafka_uid, args.listener)
        except (OSError, CredentialsError) as exc:
            print(f"rollway acl credentials: {exc}", file=sys.stderr)
            return 1
        print(f"credentials {'generated' if generated else 'kept'}: {written[0]}; per-role files and the "
              f"broker's written ({len(written) - 1} files, mode 0600)")
        return 0
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
