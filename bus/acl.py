"""Who may write what: the one ACL table of Rollway, applied to and read from the broker.

Each component role authenticates as its own SCRAM user (``rollway-<role>``, see
:mod:`bus.security`) and the broker's StandardAuthorizer allows it exactly the rows of
:data:`TABLE` (deny by default; admin and the brokers are super users). The table is
derived from what the code does (docs/security.md lists it with the reasons):

* every role may DESCRIBE the Rollway topics (metadata, end offsets: ``ensure_topics``
  checks that they exist; creating them is the admin's job);
* trainer: reads trajectories, rewards, its step log, health and dead letters (a foreign
  step-log record is dead-lettered once across restarts); writes train-steps, weights,
  metrics and dead letters; its consumer group; its transactional id;
* sampler: reads tasks and weight announcements; writes trajectories, health, metrics
  and dead letters; the samplers' group;
* grader (the sandbox service): writes rewards, nothing else;
* feeder: writes tasks and metrics, reads rewards, writes dead letters;
* evaluator: reads weights and evals, writes evals, health and dead letters; its group;
* analytics: reads every topic, writes nothing; groups named ``<analytics prefix>*``.

Writing needs no IDEMPOTENT_WRITE on the cluster (Kafka >= 3.0 allows an idempotent
producer that may write some topic). ``apply`` creates missing users and ACLs and
removes nothing; ``show`` reads back what the broker holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Literal

import msgspec

from bus.config import KafkaConfig
from bus.security import KAFKA_ROLES, Credentials, NotAuthorized, client_security, principal
from bus.topics import TOPICS

Resource = Literal["topic", "group", "transactional_id", "cluster"]


class AclNames(msgspec.Struct, kw_only=True, frozen=True):
    """The concrete names the table's rows refer to (from the whole config)."""

    prefix: str = "rollway."
    trainer_group: str = "rollway-trainer"
    trainer_transactional_id: str = "rollway.rollway-trainer"
    sampler_group: str = "rollway-samplers"
    evaluator_group: str = "rollway-evaluator"
    analytics_group_prefix: str = "rollway-analytics"


@dataclass(frozen=True)
class Grant:
    """One row: ``role`` may do ``operations`` on a resource. ``name`` is a topic short
    name, ``*`` (every Rollway topic, by prefix) or an ``AclNames`` field."""

    role: str
    resource: Resource
    name: str
    operations: tuple[str, ...]
    why: str


def _t(role: str, topic: str, ops: str, why: str) -> Grant:
    return Grant(role, "topic", topic, tuple(ops.split()), why)


TABLE: tuple[Grant, ...] = (
    *(Grant(role, "topic", "*", ("DESCRIBE",), "metadata and offsets of the Rollway topics")
      for role in KAFKA_ROLES if role != "admin"),
    _t("trainer", "trajectories", "READ", "consumes chunks; replay re-reads them"),
    _t("trainer", "rewards", "READ", "consumes rewards; replay re-reads them"),
    _t("trainer", "train-steps", "READ WRITE", "its step log: written in transactions, re-read at restart"),
    _t("trainer", "weights", "WRITE", "announces weight versions"),
    _t("trainer", "metrics", "WRITE", "trainer metrics"),
    _t("trainer", "health", "READ", "samplers' weight-update failures (keyframe on trouble)"),
    _t("trainer", "dlq", "READ WRITE", "dead-letters records it cannot use; re-reads the letters at start so a "
       "foreign step-log record is dead-lettered once across restarts (trainer/steplog.py)"),
    Grant("trainer", "group", "trainer_group", ("READ",), "its consumer group; offsets committed in its transactions"),
    Grant("trainer", "transactional_id", "trainer_transactional_id", ("WRITE", "DESCRIBE"),
          "the single writer of the step log (fences older trainers)"),
    _t("sampler", "tasks", "READ", "consumes tasks"),
    _t("sampler", "weights", "READ", "follows weight announcements"),
    _t("sampler", "trajectories", "WRITE", "publishes trajectory chunks"),
    _t("sampler", "health", "WRITE", "heartbeats"),
    _t("sampler", "metrics", "WRITE", "sampler metrics"),
    _t("sampler", "dlq", "WRITE", "dead-letters tasks it cannot run"),
    Grant("sampler", "group", "sampler_group", ("READ",), "the samplers share the tasks"),
    _t("grader", "rewards", "WRITE", "the only writer of rewards"),
    _t("feeder", "tasks", "WRITE", "publishes task groups"),
    _t("feeder", "rewards", "READ", "pass rates per task"),
    _t("feeder", "metrics", "WRITE", "feeder metrics"),
    _t("feeder", "dlq", "WRITE", "dead-letters rewards it cannot decode"),
    _t("evaluator", "weights", "READ", "evaluates new weight versions"),
    _t("evaluator", "evals", "READ WRITE", "publishes results; re-reads what was evaluated"),
    _t("evaluator", "health", "WRITE", "heartbeats"),
    _t("evaluator", "dlq", "WRITE", "dead-letters announcements it cannot decode"),
    Grant("evaluator", "group", "evaluator_group", ("READ",), "its consumer group"),
    _t("analytics", "*", "READ", "reads everything, writes nothing"),
    Grant("analytics", "group", "analytics_group_prefix", ("READ",), "consumer groups of analytics apps (prefix)"),
)


@dataclass(frozen=True, order=True)
class Rule:
    """One ACL as the broker holds it (allow rules only)."""

    principal: str
    resource: str
    pattern: str  # LITERAL or PREFIXED
    name: str
    operation: str
    host: str = "*"

    def line(self) -> str:
        return f"{self.principal:<26} {self.operation:<9} {self.resource:<16} {self.pattern:<8} {self.name}"


def rules(names: AclNames, users: dict[str, str], roles: Iterable[str] | None = None) -> list[Rule]:
    """The table made concrete: ``users`` maps role -> SCRAM user name."""
    wanted = set(KAFKA_ROLES if roles is None else roles)
    out: list[Rule] = []
    for grant in TABLE:
        if grant.role not in wanted:
            continue
        principal_name = f"User:{users[grant.role]}"
        if grant.resource == "topic":
            if grant.name == "*":
                pattern, name = "PREFIXED", names.prefix
            else:
                pattern, name = "LITERAL", TOPICS[grant.name].name(names.prefix)
        elif grant.resource == "cluster":
            pattern, name = "LITERAL", "kafka-cluster"
        else:
            name = getattr(names, grant.name)
            pattern = "PREFIXED" if grant.name.endswith("_prefix") else "LITERAL"
        out += [Rule(principal_name, grant.resource, pattern, name, op) for op in grant.operations]
    return sorted(set(out))


def default_users() -> dict[str, str]:
    from bus.security import USER_PREFIX

    return {role: USER_PREFIX + role for role in KAFKA_ROLES}


# -- the broker side (kafka-python's admin client: aiokafka's has no ACL calls) --------------

class AclError(RuntimeError):
    """The broker refused or failed an ACL or user operation."""


def admin(cfg: KafkaConfig, bootstrap_timeout_ms: int = 15_000):
    """A kafka-python admin client for ``cfg`` (the caller closes it)."""
    from kafka.admin import KafkaAdminClient
    from kafka.errors import KafkaTimeoutError

    from bus.connect import KafkaUnreachable

    # kafka-python also warns of "credentials in the clear" for any SASL without TLS;
    # SCRAM sends only a salted proof, never the password.
    # Its connection errors are retried and logged line by line; the error raised here
    # says it once.
    logging.getLogger("kafka").setLevel(logging.CRITICAL)
    try:
        return KafkaAdminClient(bootstrap_servers=cfg.bootstrap_servers.split(","),
                                client_id=f"{cfg.client_id}-acl", request_timeout_ms=cfg.request_timeout_ms,
                                bootstrap_timeout_ms=bootstrap_timeout_ms, **client_security(cfg))
    except KafkaTimeoutError:
        from bus.tls import TlsMismatch, listener_mismatch

        mismatch = listener_mismatch(cfg.bootstrap_servers, client_security(cfg).get("ssl_context"))
        if mismatch:  # reached, but TLS on one side only or an untrusted certificate
            raise TlsMismatch(mismatch) from None
        raise KafkaUnreachable(cfg.bootstrap_servers) from None


def _to_kafka(rule: Rule):
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern, ResourceType

    return ACL(principal=rule.principal, host=rule.host, operation=ACLOperation[rule.operation],
               permission_type=ACLPermissionType.ALLOW,
               resource_pattern=ResourcePattern(ResourceType[rule.resource.upper()], rule.name,
                                                ACLResourcePatternType[rule.pattern]))


def _from_kafka(acl) -> Rule:
    pattern = acl.resource_pattern
    return Rule(acl.principal, pattern.resource_type.name.lower(), pattern.pattern_type.name, pattern.resource_name,
                acl.operation.name, acl.host)


def broker_rules(client) -> list[Rule]:
    """Every ALLOW rule the broker holds (DENY rules are not Rollway's)."""
    from kafka.admin import (
        ACLFilter, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePatternFilter, ResourceType,
    )

    acls, error = client.describe_acls(ACLFilter(
        principal=None, host="*", operation=ACLOperation.ANY, permission_type=ACLPermissionType.ALLOW,
        resource_pattern=ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY)))
    if error is not None and getattr(error, "errno", 0):
        raise AclError(f"describe ACLs failed: {type(error).__name__}")
    return sorted(_from_kafka(a) for a in acls)


def ensure_users(client, creds: Credentials, roles: Iterable[str]) -> list[str]:
    """Create the SCRAM users of ``roles`` that the broker does not know. Returns them."""
    from kafka.admin import ScramMechanism, UserScramCredentialUpsertion

    users = [creds.user(role) for role in roles]
    known = client.describe_user_scram_credentials([u.username for u in users])
    missing = [u for u in users if not (known.get(u.username) or {}).get("credential_infos")]
    if missing:
        result = client.alter_user_scram_credentials([
            UserScramCredentialUpsertion(u.username, ScramMechanism.SCRAM_SHA_512, u.password, iterations=8192)
            for u in missing])
        failed = {name: err for name, err in result.items() if err}
        if failed:
            raise AclError(f"creating SCRAM users failed: {failed}")
    return [u.username for u in missing]


def apply(cfg: KafkaConfig, names: AclNames, creds: Credentials | None = None,
          users: dict[str, str] | None = None) -> tuple[list[str], list[Rule]]:
    """Make the broker hold the table (as admin ``cfg``): missing users (when ``creds``
    is given) and missing ACLs are created; nothing is removed. Idempotent. Returns the
    users and the rules created."""
    if users is None:
        users = {role: creds.user(role).username for role in KAFKA_ROLES} if creds else default_users()
    wanted = rules(names, users)
    client = admin(cfg)
    try:
        created_users = ensure_users(client, creds, KAFKA_ROLES) if creds is not None else []
        have = {(r.principal, r.resource, r.pattern, r.name, r.operation) for r in broker_rules(client)}
        new = [r for r in wanted if (r.principal, r.resource, r.pattern, r.name, r.operation) not in have]
        if new:
            result = client.create_acls([_to_kafka(r) for r in new])
            failed = result.get("failed") or []
            if failed:
                raise AclError(f"creating ACLs failed: {[(str(a), str(e)) for a, e in failed][:3]}")
        return created_users, new
    finally:
        client.close()


def show(cfg: KafkaConfig) -> list[Rule]:
    client = admin(cfg)
    try:
        return broker_rules(client)
    finally:
        client.close()


def format_rules(found: list[Rule]) -> str:
    header = f"{'principal':<26} {'operation':<9} {'resource':<16} {'pattern':<8} name"
    return "\n".join([header, *(r.line() for r in found)])


# -- the component side: refuse to start without what the table grants ------------------------

def missing_message(cfg: KafkaConfig, operation: str, resource: str, name: str) -> str:
    return (f"kafka: principal {principal(cfg)} (role {cfg.role or 'admin'}) may not {operation} {resource} {name}; "
            "run rollway acl apply as admin, or check kafka.role and the credentials")


def preflight(cfg: KafkaConfig, names: AclNames) -> None:
    """Check at start that the broker grants this process's role every topic and group
    operation of the table, through the broker's own answer (metadata with authorized
    operations; a group describe). Raises ``NotAuthorized`` (one line) or, when the
    broker is away, ``KafkaUnreachable``. The transactional id is checked by the
    producer's start (``bus.connect.start_client`` turns the refusal into NotAuthorized)."""
    from kafka.errors import SaslAuthenticationFailedError

    role = cfg.role or "admin"
    if role == "admin":
        return
    wanted = [r for r in rules(names, {role: "x"}, [role]) if r.resource in ("topic", "group")]
    try:
        client = admin(cfg, bootstrap_timeout_ms=5_000)
    except SaslAuthenticationFailedError as exc:
        raise NotAuthorized(authentication_message(cfg, exc)) from None
    try:
        topics = {TOPICS[s].name(names.prefix): s for s in TOPICS}
        described = {t["topic"] if "topic" in t else t["name"]: t for t in client.describe_topics(list(topics))}
        for rule in wanted:
            if rule.resource == "topic":
                targets = list(topics) if rule.pattern == "PREFIXED" else [rule.name]
                for topic in targets:
                    info = described.get(topic)
                    if info is None or info.get("error_code", 0) not in (0, 3):  # 3: not created yet
                        raise NotAuthorized(missing_message(cfg, rule.operation, "topic", topic))
                    ops = {getattr(o, "name", str(o)) for o in info.get("authorized_operations") or ()}
                    if info.get("error_code", 0) == 0 and rule.operation not in ops:
                        raise NotAuthorized(missing_message(cfg, rule.operation, "topic", topic))
            elif rule.pattern == "LITERAL":
                _check_group(client, cfg, rule)
    finally:
        client.close()


def _check_group(client, cfg: KafkaConfig, rule: Rule) -> None:
    from kafka.errors import GroupAuthorizationFailedError, KafkaError

    try:
        client.list_group_offsets(rule.name)
    except GroupAuthorizationFailedError:
        raise NotAuthorized(missing_message(cfg, rule.operation, "group", rule.name)) from None
    except KafkaError:
        pass  # not an authorization answer: the consumer itself will tell


def authentication_message(cfg: KafkaConfig, exc: BaseException) -> str:
    return (f"kafka: principal {principal(cfg)} (role {cfg.role or 'admin'}) could not authenticate at "
            f"{cfg.bootstrap_servers} ({type(exc).__name__}); check the credentials file or "
            "kafka.sasl_username/sasl_password")
