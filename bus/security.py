"""Who a process is on the bus: credentials per role, and the aiokafka settings for them.

The credentials file (JSON, mode 0600, written once by ``rollway broker start`` /
``rollway up`` or by ``rollway acl credentials``) holds one SCRAM user and password per
role of :data:`bus.acl.ROLES` plus the broker's own inter-broker user, and the sandbox
API's bearer tokens::

    {"kafka": {"trainer": {"username": "rollway-trainer", "password": "..."}, ...},
     "sandbox": {"sampler": "...", "evaluator": "...", "admin": "..."}}

A process picks its entry by ``KafkaConfig.role``; ``sasl_username``/``sasl_password``
(``ROLLWAY_KAFKA__SASL_USERNAME``/``..._PASSWORD``) override the file. Passwords and
tokens are never logged.
"""

from __future__ import annotations

import os
import secrets
import ssl
from pathlib import Path
from typing import Any

import msgspec

from bus.config import KafkaConfig

# Every principal Rollway creates: the component roles, the operator (admin, a super
# user) and the brokers' own inter-broker user (a super user). bus.acl holds the table.
KAFKA_ROLES = ("admin", "trainer", "sampler", "grader", "feeder", "evaluator", "analytics")
BROKER_USER = "broker"
SANDBOX_ROLES = ("admin", "sampler", "evaluator")
USER_PREFIX = "rollway-"


class CredentialsError(RuntimeError):
    """The credentials file is missing, unreadable, too open or lacks the role."""


class NotAuthorized(RuntimeError):
    """This process's principal could not authenticate, or lacks an ACL it needs: one
    line naming the principal, the resource and the operation. Services print it and
    exit (``rollway.cli``); it is never retried."""


# Who this process is, for messages (set when a command loads its config).
_identity = {"principal": "User:ANONYMOUS", "role": "admin", "bootstrap": ""}


def set_identity(cfg: KafkaConfig) -> None:
    try:
        name = principal(cfg)
    except CredentialsError:
        name = "User:?"
    _identity.update(principal=name, role=cfg.role or "admin", bootstrap=cfg.bootstrap_servers)


def who(user: str | None = None) -> str:
    """``principal User:x (role r)`` of this process, or of the SASL ``user`` a client
    logged in with when the process's identity was not set (a library caller)."""
    if user and _identity["principal"] != f"User:{user}":
        return f"principal User:{user}"
    return f"principal {_identity['principal']} (role {_identity['role']})"


def authentication_failed_message(error: object, user: str | None = None) -> str:
    return (f"kafka: {who(user)} could not authenticate at {_identity['bootstrap']} ({error}); check the credentials "
            "file (kafka.credentials_file, kafka.role) or kafka.sasl_username/sasl_password")


def denied_message(exc: BaseException, *, writing: bool = False, user: str | None = None) -> str:
    """One line for an aiokafka authorization error: principal, operation, resource."""
    from aiokafka.errors import GroupAuthorizationFailedError, TransactionalIdAuthorizationFailed

    name = ", ".join(str(a) for a in exc.args) or "?"
    if isinstance(exc, GroupAuthorizationFailedError):
        what = f"READ group {name}"
    elif isinstance(exc, TransactionalIdAuthorizationFailed):
        what = f"WRITE transactional_id {name}"
    elif type(exc).__name__.startswith("Topic"):
        what = f"{'WRITE' if writing else 'READ'} topic {name}"
    elif type(exc).__name__.startswith("Cluster"):
        what = "use this cluster-wide operation (admin only)"
    else:
        what = f"{type(exc).__name__} {name}"
    return f"kafka: {who(user)} may not {what}; run rollway acl apply as admin, or check kafka.role and the credentials"


def authorization_errors() -> tuple[type[BaseException], ...]:
    """aiokafka's and kafka-python's errors for a request the broker's authorizer refused."""
    from aiokafka import errors

    found: tuple[type[BaseException], ...] = (
        errors.TopicAuthorizationFailedError, errors.GroupAuthorizationFailedError,
        errors.TransactionalIdAuthorizationFailed, errors.ClusterAuthorizationFailedError)
    try:  # kafka-python's (bus.acl's admin client)
        from kafka.errors import AuthorizationError
    except ImportError:
        return found
    return (*found, AuthorizationError)


class UserSecret(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    username: str
    password: str

    def __repr__(self) -> str:  # never print a password by accident
        return f"UserSecret(username={self.username!r})"


class Credentials(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    kafka: dict[str, UserSecret] = {}
    sandbox: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"Credentials(kafka={sorted(self.kafka)}, sandbox={sorted(self.sandbox)})"

    def user(self, role: str) -> UserSecret:
        try:
            return self.kafka[role]
        except KeyError:
            raise CredentialsError(f"no Kafka credentials for role {role!r} (known: {', '.join(sorted(self.kafka))})") \
                from None


def generate_credentials() -> Credentials:
    """Fresh random passwords (256 bits) for every role and the broker, and sandbox tokens."""
    return Credentials(
        kafka={role: UserSecret(username=USER_PREFIX + role, password=secrets.token_urlsafe(32))
               for role in (*KAFKA_ROLES, BROKER_USER)},
        sandbox={role: secrets.token_urlsafe(32) for role in SANDBOX_ROLES},
    )


def write_credentials(path: str | os.PathLike[str], creds: Credentials) -> None:
    """Write ``creds`` readable by the owner only (created 0600, never world-readable
    for an instant)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(msgspec.json.format(msgspec.json.encode(creds), indent=2))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def load_credentials(path: str | os.PathLike[str]) -> Credentials:
    path = Path(path)
    try:
        mode = path.stat().st_mode
        raw = path.read_bytes()
    except OSError as exc:
        raise CredentialsError(f"cannot read the credentials file {path}: {exc.strerror}") from None
    if mode & 0o077:
        raise CredentialsError(f"the credentials file {path} is readable by others (mode {mode & 0o777:o}); "
                               f"chmod 600 {path}")
    try:
        return msgspec.json.decode(raw, type=Credentials)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CredentialsError(f"the credentials file {path} is not valid: {exc}") from None


def role_credentials(creds: Credentials, role: str) -> Credentials:
    """What a process of ``role`` may hold: its own Kafka user and sandbox token only
    (docker-compose.yml gives each service such a file). The grader's holds every
    sandbox token: the sandbox service checks them. The admin's is everything."""
    if role == "admin":
        return creds
    sandbox = dict(creds.sandbox) if role == "grader" else \
        {role: creds.sandbox[role]} if role in creds.sandbox else {}
    return Credentials(kafka={role: creds.user(role)}, sandbox=sandbox)


def ensure_credentials(path: str | os.PathLike[str]) -> Credentials:
    """The credentials at ``path``, generated on first use."""
    if not Path(path).exists():
        write_credentials(path, generate_credentials())
    return load_credentials(path)


def sasl_user(cfg: KafkaConfig) -> UserSecret | None:
    """The SASL user this process authenticates as, or None (no credentials: open mode)."""
    if cfg.sasl_username:
        return UserSecret(username=cfg.sasl_username, password=cfg.sasl_password)
    if cfg.credentials_file:
        return load_credentials(cfg.credentials_file).user(cfg.role or "admin")
    return None


def security_protocol(cfg: KafkaConfig) -> str:
    """``kafka.security_protocol``; "auto": SASL_SSL with credentials and a CA file
    (``rollway broker start --tls`` prints both), SASL_PLAINTEXT with credentials only,
    else PLAINTEXT (an open broker)."""
    if cfg.security_protocol != "auto":
        return cfg.security_protocol
    if not (cfg.sasl_username or cfg.credentials_file):
        return "PLAINTEXT"
    return "SASL_SSL" if cfg.ssl_cafile else "SASL_PLAINTEXT"


def principal(cfg: KafkaConfig) -> str:
    """``User:<name>`` as the broker sees this process (``User:ANONYMOUS`` in open mode)."""
    user = sasl_user(cfg) if security_protocol(cfg) != "PLAINTEXT" else None
    return f"User:{user.username}" if user else "User:ANONYMOUS"


def client_security(cfg: KafkaConfig) -> dict[str, Any]:
    """Client keyword arguments for ``cfg``'s security settings (none in open mode); the
    names are the same for aiokafka and kafka-python (bus.acl's admin)."""
    protocol = security_protocol(cfg)
    if protocol == "PLAINTEXT":
        return {}
    user = sasl_user(cfg)
    if user is None:
        raise CredentialsError(f"kafka.security_protocol = {protocol} needs credentials: set kafka.credentials_file "
                               "or kafka.sasl_username and kafka.sasl_password")
    out: dict[str, Any] = dict(security_protocol=protocol, sasl_mechanism=cfg.sasl_mechanism,
                               sasl_plain_username=user.username, sasl_plain_password=user.password)
    if protocol == "SASL_SSL":
        out["ssl_context"] = ssl_context(cfg)
    return out


def ssl_context(cfg: KafkaConfig) -> ssl.SSLContext:
    """The client TLS context: verifies the broker's certificate against
    ``kafka.ssl_cafile`` (else the system's CAs) and its hostname."""
    if cfg.ssl_cafile and not Path(cfg.ssl_cafile).is_file():
        raise CredentialsError(f"kafka.ssl_cafile {cfg.ssl_cafile} is not a readable file")
    context = ssl.create_default_context(cafile=cfg.ssl_cafile or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def set_sandbox_token(token: str) -> None:
    """The sandbox API token of this process's role (set when a command loads its config)."""
    _identity["sandbox_token"] = token


def process_sandbox_token() -> str:
    """``$ROLLWAY_SANDBOX_TOKEN``, else the token of this process's role, else "" (an open
    sandbox). ``sandbox.client.SandboxClient`` sends it."""
    return os.environ.get("ROLLWAY_SANDBOX_TOKEN", "").strip() or _identity.get("sandbox_token", "")
