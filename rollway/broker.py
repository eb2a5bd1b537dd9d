"""Local Apache Kafka in KRaft mode, from the jars ``scripts/setup`` fetched.

``LocalKafka`` starts 1 or 3 combined broker+controller JVMs on loopback, each its own
process with its own ports and data folder, and returns once every broker answers
metadata requests. State (pids, ports) is written to ``<data_dir>/cluster.json`` so
``rollway broker stop|status`` from another process can find them.

With ``secure=True`` (``rollway broker start`` and ``rollway up`` by default, ``--insecure``
opts out) clients must authenticate with SASL/SCRAM-SHA-512 on the broker listener and
the StandardAuthorizer enforces bus.acl's table: the users of the credentials file
(``<data_dir>/credentials.json``, 0600, generated on first start) are created when the
storage is formatted, and the super users are the admin and the brokers' own user. The
controller listener stays PLAINTEXT, bound to loopback only (KRaft cannot take SCRAM
there); its anonymous principal is a super user so brokers and controllers can talk.

With ``tls=True`` as well (``rollway broker start --tls``) the broker listener is SASL_SSL:
a local CA and a broker certificate for 127.0.0.1 and localhost are generated on first start into
``<data_dir>/tls/`` (bus.tls); clients trust ``<data_dir>/tls/ca.pem`` (``kafka.ssl_cafile``).
Inter-broker traffic runs on the same listener, so it is encrypted too.

With ``KAFKA_BOOTSTRAP_SERVERS`` set, callers use that cluster and start nothing
(see :func:`external_bootstrap`).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_KAFKA_VERSION = "4.1.1"

LOG4J2_PROPERTIES = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = {level}
logger.state.name = state.change.logger
logger.state.level = warn
"""


class BrokerError(RuntimeError):
    """The local Kafka could not be started, found or stopped."""


def external_bootstrap() -> str | None:
    """The externally managed cluster to use instead of launching one, if any."""
    value = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    return value or None


def kafka_libs(version: str | None = None) -> Path:
    version = version or os.environ.get("ROLLWAY_KAFKA_VERSION", DEFAULT_KAFKA_VERSION)
    cache = Path(os.environ.get("ROLLWAY_CACHE", REPO_ROOT / ".cache"))
    libs = cache / f"kafka-{version}" / "libs"
    if not (libs / f"kafka_2.13-{version}.jar").exists():
        raise BrokerError(f"Kafka {version} jars not found in {libs}; run scripts/setup")
    return libs


def free_ports(count: int) -> list[int]:
    """Ports the OS says are free now (bound then released, all at once)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class NodeState:
    node_id: int
    port: int
    controller_port: int
    pid: int = 0
    log_file: str = ""


@dataclass
class ClusterState:
    data_dir: str
    nodes: list[NodeState] = field(default_factory=list)
    # SASL/SCRAM + ACLs; clients take the users of credentials_file.
    secure: bool = False
    credentials_file: str = ""
    # SASL_SSL listeners (secure only): the CA clients trust, "" without TLS.
    ca_file: str = ""

    def client_config(self, role: str = "admin"):
        """A ``KafkaConfig`` of ``role`` for this cluster (bootstrap, credentials, CA)."""
        from bus.config import KafkaConfig

        if not self.secure:
            return KafkaConfig(bootstrap_servers=self.bootstrap)
        return KafkaConfig(bootstrap_servers=self.bootstrap, credentials_file=self.credentials_file, role=role,
                           ssl_cafile=self.ca_file)

    def admin_security(self) -> dict:
        """Client settings of the admin user (none for an open cluster)."""
        if not self.secure:
            return {}
        from bus.security import client_security

        return client_security(self.client_config("admin"))

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def save(self) -> None:
        Path(self.data_dir, "cluster.json").write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, data_dir: str | Path) -> "ClusterState":
        path = Path(data_dir, "cluster.json")
        if not path.exists():
            raise BrokerError(f"no cluster state in {path}; is a broker running from {data_dir}?")
        raw = json.loads(path.read_text())
        return cls(data_dir=raw["data_dir"], nodes=[NodeState(**n) for n in raw["nodes"]],
                   secure=raw.get("secure", False), credentials_file=raw.get("credentials_file", ""),
                   ca_file=raw.get("ca_file", ""))


def secure_broker_properties(creds, listener: str) -> dict[str, str]:
    """The broker settings of a secured cluster (also docker-compose.yml's broker, through
    ``rollway acl credentials``): SCRAM-SHA-512 on ``listener`` (clients and inter-broker,
    as the ``broker`` user of ``creds``), the StandardAuthorizer, deny by default, super
    users admin and broker. Holds the broker's password: write it 0600."""
    from bus.security import BROKER_USER

    broker, admin = creds.user(BROKER_USER), creds.user("admin")
    jaas = (f'org.apache.kafka.common.security.scram.ScramLoginModule required '
            f'username="{broker.username}" password="{broker.password}";')
    return {
        "sasl.enabled.mechanisms": "SCRAM-SHA-512",
        "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
        f"listener.name.{listener.lower()}.scram-sha-512.sasl.jaas.config": jaas,
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        # ANONYMOUS is only ever the controller listener's principal (loopback only).
        "super.users": f"User:{admin.username};User:{broker.username};User:ANONYMOUS",
    }


def scram_format_args(creds, roles: tuple[str, ...] | None = None) -> list[str]:
    """``kafka-storage format`` arguments creating the SCRAM users of ``roles`` (all of
    ``creds`` when None): KRaft needs the brokers' user before they first talk."""
    users = creds.kafka.values() if roles is None else [creds.user(r) for r in roles]
    return [arg for user in users
            for arg in ("--add-scram", f"SCRAM-SHA-512=[name={user.username},password={user.password}]")]


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); look at its state.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


class LocalKafka:
    """A 1- or 3-node KRaft cluster of real Apache Kafka processes on loopback."""

    def __init__(
        self,
        data_dir: str | Path,
        nodes: int = 1,
        ports: list[int] | None = None,
        heap: str = "512m",
        log_level: str = "INFO",
        version: str | None = None,
        secure: bool = False,
        tls: bool = False,
    ) -> None:
        if nodes not in (1, 3):
            raise BrokerError(f"--nodes must be 1 or 3, not {nodes}")
        if tls and not secure:
            raise BrokerError("TLS listeners come with SASL/SCRAM and ACLs: --tls cannot go with --insecure")
        self.data_dir = Path(data_dir).resolve()
        self.num_nodes = nodes
        self.ports = ports
        self.heap = heap
        self.log_level = log_level
        self.version = version
        self.secure = secure
        self.tls = tls
        self.state = ClusterState(data_dir=str(self.data_dir), secure=secure,
                                  credentials_file=str(self.data_dir / "credentials.json") if secure else "",
                                  ca_file=str(self.data_dir / "tls" / "ca.pem") if tls else "")
        self._creds = None
        self._tls = None
        self._procs: dict[int, subprocess.Popen] = {}

    # -- configuration -----------------------------------------------------------
    def _server_properties(self, node: NodeState) -> str:
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.state.nodes)
        rf = 3 if self.num_nodes == 3 else 1
        min_isr = 2 if self.num_nodes == 3 else 1
        listener = self.listener
        props = {
            "process.roles": "broker,controller",
            "node.id": node.node_id,
            "controller.quorum.voters": voters,
            "listeners": f"{listener}://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
            "advertised.listeners": f"{listener}://127.0.0.1:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": listener,
            "listener.security.protocol.map": f"{listener}:{listener},CONTROLLER:PLAINTEXT",
            **(self._security_properties() if self.secure else {}),
            "log.dirs": str(self.data_dir / f"node-{node.node_id}" / "data"),
            "num.partitions": 3,
            "default.replication.factor": rf,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": 6,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": min_isr,
            "transaction.state.log.num.partitions": 6,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": min_isr,
            # Components create their topics (bus.ensure_topics); a typo must not
            # silently create a one-partition topic.
            "auto.create.topics.enable": "false",
            "group.initial.rebalance.delay.ms": 0,
            "unclean.leader.election.enable": "false",
        }
        return "".join(f"{k}={v}\n" for k, v in props.items())

    @property
    def listener(self) -> str:
        return ("SASL_SSL" if self.tls else "SASL_PLAINTEXT") if self.secure else "PLAINTEXT"

    def _security_properties(self) -> dict[str, str]:
        props = secure_broker_properties(self._creds, self.listener)
        if self._tls:
            props.update(self._tls.server_properties(self.listener))
        return props

    def _java(self, node_dir: Path) -> list[str]:
        """The JVM argv (heap, classpath, the node's log4j2 config) before the main class."""
        java_home = os.environ.get("JAVA_HOME")
        java = str(Path(java_home, "bin", "java")) if java_home else "java"
        return [java, f"-Xmx{self.heap}", f"-Xms{self.heap}", "-XX:+UseG1GC",
                "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={node_dir / 'log4j2.properties'}",
                "-cp", str(kafka_libs(self.version) / "*")]

    # -- lifecycle -------------------------------------------------------------------
    def start(self, timeout: float = 90.0) -> str:
        """Format storage if new, start every node, wait until all brokers answer."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = self.ports or free_ports(2 * self.num_nodes)
        if len(ports) < 2 * self.num_nodes:
            raise BrokerError(f"need {2 * self.num_nodes} ports, got {ports}")
        self.state.nodes = [
            NodeState(node_id=i + 1, port=ports[2 * i], controller_port=ports[2 * i + 1])
            for i in range(self.num_nodes)
        ]
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if self.secure:
            from bus.security import ensure_credentials

            formatted = any((self.data_dir / f"node-{n.node_id}" / "data" / "meta.properties").exists()
                            for n in self.state.nodes)
            if formatted and not Path(self.state.credentials_file).exists():
                raise BrokerError(f"{self.data_dir} holds a cluster formatted without users (started with "
                                  "--insecure): start it with --insecure, or remove the folder to start a secure one")
            self._creds = ensure_credentials(self.state.credentials_file)
        if self.tls:
            from bus.tls import ensure_broker_tls

            # The listeners bind loopback only: the certificate names 127.0.0.1 and localhost.
            self._tls = ensure_broker_tls(self.data_dir / "tls")
        for node in self.state.nodes:
            node_dir = self.data_dir / f"node-{node.node_id}"
            node_dir.mkdir(parents=True, exist_ok=True)
            node.log_file = str(node_dir / "server.log")
            # Holds the broker's password when secure: the owner's only.
            props_file = node_dir / "server.properties"
            props_file.touch(mode=0o600)
            props_file.chmod(0o600)
            props_file.write_text(self._server_properties(node))
            (node_dir / "log4j2.properties").write_text(
                LOG4J2_PROPERTIES.format(log_file=node.log_file, level=self.log_level)
            )
            if not (node_dir / "data" / "meta.properties").exists():
                self._format(node_dir, cluster_id)
        for node in self.state.nodes:
            self._spawn(node)
        self.state.save()
        self.wait_ready(timeout)
        log.info("kafka started", bootstrap=self.state.bootstrap, nodes=self.num_nodes,
                 data_dir=str(self.data_dir))
        return self.state.bootstrap

    def _format(self, node_dir: Path, cluster_id: str) -> None:
        cmd = [*self._java(node_dir), "kafka.tools.StorageTool", "format", f"--cluster-id={cluster_id}",
               "-c", str(node_dir / "server.properties"), "--ignore-formatted"]
        if self.secure:
            # KRaft: SCRAM users must exist before the brokers first talk to each other.
            cmd += scram_format_args(self._creds)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BrokerError(f"kafka storage format failed in {node_dir}: {proc.stderr or proc.stdout}")

    def _spawn(self, node: NodeState) -> None:
        node_dir = self.data_dir / f"node-{node.node_id}"
        cmd = [*self._java(node_dir), "kafka.Kafka", str(node_dir / "server.properties")]
        out = open(node_dir / "stdout.log", "ab")
        # Own session: the broker outlives `rollway broker start` and a Ctrl-C in the
        # shell that started it does not reach it; `stop` kills it explicitly.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=node_dir)
        out.close()
        node.pid = proc.pid
        self._procs[node.node_id] = proc

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            for node in self.state.nodes:
                proc = self._procs.get(node.node_id)
                if proc is not None and proc.poll() is not None:
                    raise BrokerError(
                        f"kafka node {node.node_id} exited with {proc.returncode}; "
                        f"log: {node.log_file}\n{tail_file(node.log_file)}"
                    )
            if not all(port_open(n.port) for n in self.state.nodes):
                last_error = BrokerError("broker ports not accepting connections yet")
                time.sleep(0.3)
                continue
            try:
                brokers = metadata_brokers(self.state.bootstrap, timeout=5.0, security=self.state.admin_security())
                if len(brokers) >= self.num_nodes:
                    return
                last_error = BrokerError(f"{len(brokers)}/{self.num_nodes} brokers registered")
            except Exception as exc:  # not up yet
                last_error = exc
            time.sleep(0.5)
        raise BrokerError(
            f"kafka did not answer metadata requests within {timeout}s ({last_error}); "
            f"logs: {', '.join(n.log_file for n in self.state.nodes)}"
        )

    def restart_node(self, node_id: int, timeout: float = 90.0) -> None:
        node = self._node(node_id)
        if pid_alive(node.pid):
            raise BrokerError(f"node {node_id} is still running (pid {node.pid})")
        self._spawn(node)
        self.state.save()
        self.wait_ready(timeout)

    def _node(self, node_id: int) -> NodeState:
        for node in self.state.nodes:
            if node.node_id == node_id:
                return node
        raise BrokerError(f"no node {node_id}")

    def stop(self, timeout: float = 30.0) -> None:
        stop_cluster(self.state, timeout)
        for proc in self._procs.values():
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass


def stop_cluster(state: ClusterState, timeout: float = 30.0) -> list[int]:
    """SIGTERM every node (clean shutdown), SIGKILL what is left after ``timeout``."""
    pids = [n.pid for n in state.nodes if pid_alive(n.pid)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.2)
    for pid in pids:
        if pid_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return pids


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def tail_file(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def metadata_brokers(bootstrap: str, timeout: float = 5.0, security: dict | None = None) -> list[int]:
    """Node ids of the brokers the cluster reports in a metadata response (``security``:
    client settings, ``ClusterState.admin_security``)."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    async def ask() -> list[int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000),
                                    **(security or {}))
        try:
            await asyncio.wait_for(admin.start(), timeout)
        except BaseException:
            await admin.close()  # no "Unclosed" warning for a broker that is not up yet
            raise
        try:
            info = await asyncio.wait_for(admin.describe_cluster(), timeout)
            return sorted(b["node_id"] for b in info["brokers"])
        finally:
            await admin.close()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(ask())
    # Called from async code (a test restarting a node): use a private loop elsewhere.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, ask()).result()
