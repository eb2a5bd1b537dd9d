"""TLS listeners (#32): ``rollway broker start --tls`` on a real broker.

One broker for the module, started by the command a user runs (SASL_SSL: a local CA and
broker certificate under ``<data-dir>/tls/``, SCRAM users, the ACL table). A client that
trusts the CA connects and the ACLs still hold over TLS; a client without the CA, a
plaintext client on the TLS listener and a TLS client on a plaintext listener each fail
at once with one line saying what is wrong (aiokafka alone says "Unable to bootstrap",
which a service would retry forever).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from aiokafka.errors import TopicAuthorizationFailedError
from cryptography import x509
from cryptography.hazmat.primitives.serialization import pkcs12

from bus import EventProducer, ensure_topics
from bus.acl import AclNames, apply
from bus.config import KafkaConfig
from bus.reader import read_topic_records
from bus.security import load_credentials
from bus.tls import TlsMismatch, ensure_broker_tls
from rollway.broker import ClusterState
from tests.conftest import TEST_PARTITIONS, unique

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parent.parent


def _rollway(*argv: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLWAY_", "KAFKA_"))}
    return subprocess.run([sys.executable, "-m", "rollway.cli", "--config", "/dev/null", *argv], cwd=REPO,
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory):
    data_dir = tmp_path_factory.mktemp("kafka-tls")
    started = _rollway("broker", "start", "--tls", "--port", "0", "--heap", "384m", "--data-dir", str(data_dir))
    try:
        assert started.returncode == 0, started.stderr[-3000:]
        exports = dict(line[len("export "):].split("=", 1) for line in started.stdout.splitlines()
                       if line.startswith("export "))
        yield exports, data_dir
    finally:
        _rollway("broker", "stop", "--data-dir", str(data_dir), timeout=60)


@pytest.fixture(scope="module")
def tls(tls_broker) -> dict[str, str]:
    exports, data_dir = tls_broker
    return {"bootstrap": exports["KAFKA_BOOTSTRAP_SERVERS"], "credentials": exports["ROLLWAY_KAFKA__CREDENTIALS_FILE"],
            "ca": exports["ROLLWAY_KAFKA__SSL_CAFILE"], "data_dir": str(data_dir)}


def _cfg(tls: dict[str, str], role: str, prefix: str, **overrides) -> KafkaConfig:
    fields = dict(bootstrap_servers=tls["bootstrap"], credentials_file=tls["credentials"], role=role,
                  ssl_cafile=tls["ca"], topic_prefix=prefix, partitions=dict(TEST_PARTITIONS),
                  client_id=f"test-tls-{role}", request_timeout_ms=10_000)
    fields.update(overrides)
    return KafkaConfig(**fields)


def test_broker_start_tls_prints_the_ca_and_keeps_keys_private(tls):
    data_dir = Path(tls["data_dir"])
    assert tls["ca"] == str(data_dir / "tls" / "ca.pem")
    assert ClusterState.load(data_dir).ca_file == tls["ca"]
    folder = data_dir / "tls"
    assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()} == {
        "ca.pem": 0o644, "ca-key.pem": 0o600, "broker.p12": 0o600, "broker.key-password": 0o600}
    assert folder.stat().st_mode & 0o777 == 0o700
    ca = x509.load_pem_x509_certificate((folder / "ca.pem").read_bytes())
    store = pkcs12.load_pkcs12((folder / "broker.p12").read_bytes(), (folder / "broker.key-password").read_bytes())
    cert = store.cert.certificate
    cert.verify_directly_issued_by(ca)  # raises unless the CA signed it
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} == {"127.0.0.1"}
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    # The password of the keystore sits in the broker's properties, which are the owner's only.
    props = data_dir / "node-1" / "server.properties"
    assert props.stat().st_mode & 0o777 == 0o600
    assert "SASL_SSL://127.0.0.1:" in props.read_text()
    status = _rollway("broker", "status", "--data-dir", str(data_dir), timeout=60)
    assert status.returncode == 0 and status.stdout.splitlines()[-1] == "brokers answering: [1]", status.stdout
    # A second start keeps the CA and the broker certificate (clients keep trusting ca.pem).
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    ensure_broker_tls(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


async def test_a_client_trusting_the_ca_connects_and_the_acls_hold_over_tls(tls):
    prefix = f"{unique('tls-')}."
    admin = _cfg(tls, "admin", prefix)
    await ensure_topics(admin)
    apply(admin, AclNames(prefix=prefix, trainer_group=f"{prefix}trainer", sampler_group=f"{prefix}samplers",
                          trainer_transactional_id=f"{prefix}tx"), load_credentials(tls["credentials"]))
    sampler = _cfg(tls, "sampler", prefix)
    async with EventProducer(sampler) as producer:
        await producer.publish_raw(prefix + "trajectories", b"over-tls", key=b"k")
        with pytest.raises(TopicAuthorizationFailedError):
            await producer.publish_raw(prefix + "rewards", b"forged", key=b"k")
    records = await read_topic_records(_cfg(tls, "trainer", prefix), prefix + "trajectories")
    assert [r.value for r in records] == [b"over-tls"]


async def test_a_client_without_the_ca_fails_at_once_naming_the_fix(tls):
    # SASL_SSL with the system's CAs only: the local CA is not among them.
    cfg = _cfg(tls, "sampler", f"{unique('tls-')}.", ssl_cafile="", security_protocol="SASL_SSL")
    with pytest.raises(TlsMismatch) as caught:
        await ensure_topics(cfg)
    host_port = tls["bootstrap"]
    message = str(caught.value)
    assert message.startswith(f"kafka: the broker at {host_port} presented a certificate this client does not trust (")
    assert message.endswith("); set kafka.ssl_cafile to the CA that signed it "
                            "(rollway broker start --tls writes <data-dir>/tls/ca.pem)")
    assert "certificate" in message.split("(")[1]  # OpenSSL's reason, e.g. "self-signed certificate in ..."


PLAINTEXT_ON_TLS = ('kafka: {} is a TLS listener and this client speaks plaintext; set kafka.security_protocol = '
                    '"SASL_SSL" and kafka.ssl_cafile to the CA that signed the broker\'s certificate '
                    '(rollway broker start --tls writes <data-dir>/tls/ca.pem)')


@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "PLAINTEXT"])
async def test_a_plaintext_client_on_the_tls_listener_fails_at_once(tls, protocol):
    cfg = _cfg(tls, "sampler", f"{unique('tls-')}.", ssl_cafile="", security_protocol=protocol)
    with pytest.raises(TlsMismatch) as caught:
        await ensure_topics(cfg)
    assert str(caught.value) == PLAINTEXT_ON_TLS.format(tls["bootstrap"])


def test_a_component_without_tls_settings_exits_3_with_one_line(tls):
    # The credentials but not the CA: "auto" picks SASL_PLAINTEXT. A service would
    # otherwise wait forever for a broker it cannot talk to.
    run = _rollway("sampler", env={"KAFKA_BOOTSTRAP_SERVERS": tls["bootstrap"],
                                   "ROLLWAY_KAFKA__CREDENTIALS_FILE": tls["credentials"]}, timeout=120)
    assert run.returncode == 3, run.stderr[-2000:]
    assert run.stderr.strip() == PLAINTEXT_ON_TLS.format(tls["bootstrap"])


async def test_a_tls_client_on_a_plaintext_listener_fails_at_once(tls, kafka_bootstrap):
    # The suite's open broker: a plaintext listener. The CA and credentials are valid ones.
    cfg = _cfg(tls, "sampler", f"{unique('tls-')}.", bootstrap_servers=kafka_bootstrap)
    with pytest.raises(TlsMismatch, match=r"did not complete a TLS handshake \(.+\): it is not a TLS listener; set "
                                          r"kafka.security_protocol to SASL_PLAINTEXT"):
        await ensure_topics(cfg)


def test_tls_goes_with_authentication_only():
    run = _rollway("broker", "start", "--tls", "--insecure", "--data-dir", "/nonexistent-never-created")
    assert run.returncode == 2
    assert run.stderr.strip() == "rollway broker: --tls comes with SASL/SCRAM and ACLs; drop --insecure"
    assert not Path("/nonexistent-never-created").exists()
