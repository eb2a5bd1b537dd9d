"""docker-compose.yml's secured bus (#32), its pieces run for real without Docker.

No image registry is reachable where the suite runs, so the stack itself is not started
here (docs/compose.md says what was run). What is run: the credentials service's command
(``rollway acl credentials``), the broker's entrypoint ``deploy/kafka/secure-start.sh``
with the kafka service's own environment from docker-compose.yml (ports moved to free
ones, ``kafka`` -> 127.0.0.1) on the real Kafka jars, the init service's ``rollway acl
apply`` as admin, and every component's start-up check with the one file its service
mounts. The compose file's wiring (which volume each service mounts) is read from the
file itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from aiokafka.errors import TopicAuthorizationFailedError

from bus import EventProducer
from bus.acl import preflight
from bus.config import KafkaConfig
from bus.security import KAFKA_ROLES, SANDBOX_ROLES, CredentialsError, load_credentials
from rollway.broker import free_ports, kafka_libs, metadata_brokers, tail_file
from rollway.commands.acl import COMMAND_ROLES, acl_names
from rollway.config import load_config
from tests.waiting import wait_until

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def _secrets_volume(service: dict) -> tuple[str, str] | None:
    """(volume, mount point) of the service's secrets volume, if any; mounted read-only."""
    found = [v.split(":") for v in service.get("volumes", []) if v.startswith("secrets-")]
    assert len(found) <= 1, found
    if not found:
        return None
    assert found[0][2:] == ["ro"], found
    return found[0][0], found[0][1]


def _role_of(service: dict) -> str:
    command = service.get("command") or []
    return COMMAND_ROLES.get(command[0], "admin") if command else "admin"


def _rollway(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLWAY_", "KAFKA_"))}
    return subprocess.run([sys.executable, "-m", "rollway.cli", *argv], cwd=REPO, env={**base, **env},
                          capture_output=True, text=True, timeout=120)


def test_each_service_mounts_only_its_own_principal_and_no_secret_is_in_the_file():
    components = {name: s for name, s in SERVICES.items() if name not in ("kafka", "minio", "credentials")}
    for name, service in components.items():
        volume, mount = _secrets_volume(service)
        assert volume == f"secrets-{_role_of(service)}", name
        assert mount == "/run/rollway", name
        assert service["environment"]["ROLLWAY_KAFKA__CREDENTIALS_FILE"] == "/run/rollway/credentials.json"
        if name != "init":
            assert service["depends_on"] == {"init": {"condition": "service_completed_successfully"}}
    assert {_role_of(s) for s in components.values()} == set(KAFKA_ROLES)  # every principal is used
    assert _secrets_volume(SERVICES["kafka"]) == ("secrets-kafka", "/run/rollway")
    assert SERVICES["kafka"]["depends_on"] == {"credentials": {"condition": "service_completed_successfully"}}
    credentials = SERVICES["credentials"]
    assert credentials["command"][:4] == ["acl", "credentials", "--out-dir", "/secrets"]
    # Each volume is mounted where the command writes that principal's folder.
    written = dict(v.split(":") for v in credentials["volumes"])
    assert written == {f"secrets-{r}": f"/secrets/{r}" for r in (*KAFKA_ROLES, "kafka")}
    assert set(written) <= set(COMPOSE["volumes"])
    assert "rollway acl apply" in SERVICES["init"]["command"][0]
    text = (REPO / "docker-compose.yml").read_text().lower()
    assert "jaas" not in text and "scram-sha-512=[" not in text and "password=" not in text


@pytest.fixture(scope="module")
def compose_broker(tmp_path_factory: pytest.TempPathFactory):
    """The credentials service's files, and the kafka service run by its entrypoint."""
    work = tmp_path_factory.mktemp("compose")
    made = _rollway("acl", "credentials", "--out-dir", str(work / "secrets"), env={})
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"credentials generated: {work}/secrets/admin/credentials.json;")
    port, controller = free_ports(2)
    env = {k: str(v) for k, v in SERVICES["kafka"]["environment"].items()}
    env = {k: v.replace("://:9092", f"://127.0.0.1:{port}").replace("kafka:9092", f"127.0.0.1:{port}")
           .replace("9093", str(controller)) for k, v in env.items()}
    env.update(ROLLWAY_SECRETS=str(work / "secrets" / "kafka"), KAFKA_LIBS=str(kafka_libs()),
               KAFKA_LOG_DIRS=str(work / "data"), KAFKA_HEAP_OPTS="-Xmx384m -Xms384m",
               PATH=os.environ["PATH"], HOME=str(work))
    entrypoint = SERVICES["kafka"]["entrypoint"]
    assert entrypoint == ["/bin/sh", "/opt/rollway/secure-start.sh"]
    assert "./deploy/kafka/secure-start.sh:/opt/rollway/secure-start.sh:ro" in SERVICES["kafka"]["volumes"]
    log = work / "kafka.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["/bin/sh", str(REPO / "deploy/kafka/secure-start.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    bootstrap = f"127.0.0.1:{port}"
    admin = KafkaConfig(bootstrap_servers=bootstrap, credentials_file=str(work / "secrets/admin/credentials.json"),
                        role="admin")
    from bus.security import client_security

    def answers() -> bool:
        try:
            return metadata_brokers(bootstrap, timeout=5, security=client_security(admin)) == [1]
        except Exception:  # noqa: BLE001 - not up yet: any failure means ask again
            return False

    try:
        try:
            wait_until(answers, 120, "the compose broker's answer", proc=proc, poll_s=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{tail_file(str(log), 40)}") from None
        yield work, bootstrap
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_the_credentials_service_splits_secrets_per_principal(compose_broker):
    work, _ = compose_broker
    secrets = work / "secrets"
    master = load_credentials(secrets / "admin/credentials.json")
    for role in KAFKA_ROLES:
        if role == "admin":
            continue
        own = load_credentials(secrets / role / "credentials.json")  # refuses a file others may read
        assert own.kafka == {role: master.kafka[role]}
        wanted = master.sandbox if role == "grader" else {r: master.sandbox[r] for r in SANDBOX_ROLES if r == role}
        assert own.sandbox == wanted
    assert {p.name: p.stat().st_mode & 0o777 for p in (secrets / "kafka").iterdir()} == {
        "broker.properties": 0o600, "client.properties": 0o600, "scram-users": 0o600}
    users = (secrets / "kafka/scram-users").read_text().splitlines()
    assert [re.sub(r"password=[^\]]+", "password=*", u) for u in users] == [
        "SCRAM-SHA-512=[name=rollway-admin,password=*]", "SCRAM-SHA-512=[name=rollway-broker,password=*]"]
    # A second run (a second `docker compose up`) keeps every secret.
    again = _rollway("acl", "credentials", "--out-dir", str(secrets), env={})
    assert again.stdout.startswith("credentials kept:")
    assert load_credentials(secrets / "admin/credentials.json") == master


async def test_init_applies_the_table_and_each_service_starts_as_its_principal(compose_broker):
    work, bootstrap = compose_broker
    secrets = work / "secrets"
    init_env = {"KAFKA_BOOTSTRAP_SERVERS": bootstrap, "ROLLWAY_KAFKA__CREDENTIALS_FILE": str(secrets / "admin/credentials.json")}
    first = _rollway("--config", "/dev/null", "acl", "apply", env=init_env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("users created: rollway-trainer, rollway-sampler, rollway-grader, rollway-feeder, "
                                   "rollway-evaluator, rollway-analytics; ACLs created: ")
    again = _rollway("--config", "/dev/null", "acl", "apply", env=init_env)  # a second `up`
    assert again.stdout.startswith("users created: none; ACLs created: 0 ")
    # The compose config's names (deploy/rollway.compose.toml), the bootstrap moved here.
    compose_cfg = load_config(str(REPO / "deploy/rollway.compose.toml"), environ={})
    names = acl_names(compose_cfg)
    for name, service in SERVICES.items():
        if name in ("kafka", "minio", "credentials"):
            continue
        role = _role_of(service)
        volume, _ = _secrets_volume(service)
        cfg = KafkaConfig(bootstrap_servers=bootstrap, role=role,
                          credentials_file=str(secrets / volume.removeprefix("secrets-") / "credentials.json"))
        preflight(cfg, names)  # what the service's start checks: the broker grants its rows
    sampler_file = str(secrets / "sampler/credentials.json")
    sampler = KafkaConfig(bootstrap_servers=bootstrap, role="sampler", credentials_file=sampler_file)
    async with EventProducer(sampler) as producer:
        await producer.publish_raw("rollway.trajectories", b"chunk", key=b"k")
        with pytest.raises(TopicAuthorizationFailedError):
            await producer.publish_raw("rollway.rewards", b"forged", key=b"k")
    # The sampler container holds no other principal's password.
    with pytest.raises(CredentialsError, match="no Kafka credentials for role 'trainer' \\(known: sampler\\)"):
        preflight(KafkaConfig(bootstrap_servers=bootstrap, role="trainer", credentials_file=sampler_file), names)
    # The health check's login (client.properties) is the broker's own user.
    props = dict(line.split("=", 1) for line in (secrets / "kafka/client.properties").read_text().splitlines())
    user, password = re.fullmatch(r'.*username="([^"]+)" password="([^"]+)";', props["sasl.jaas.config"]).groups()
    broker = KafkaConfig(bootstrap_servers=bootstrap, sasl_username=user, sasl_password=password)
    from bus.security import client_security

    assert user == "rollway-broker" and props["security.protocol"] == "SASL_PLAINTEXT"
    assert metadata_brokers(bootstrap, security=client_security(broker)) == [1]
