"""``rollway broker start|stop|status``: a local Apache Kafka in KRaft mode."""

from __future__ import annotations

import argparse

DEFAULT_DATA_DIR = "var/kafka"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    start = sub.add_parser("start", help="start brokers and wait until they answer")
    start.add_argument("--nodes", type=int, choices=[1, 3], default=1)
    start.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    start.add_argument("--port", type=int, default=9092,
                       help="first broker port; controllers and further nodes take the next ones "
                            "(0 = any free ports)")
    start.add_argument("--heap", default="512m", help="JVM heap per node")
    start.add_argument("--timeout", type=float, default=120.0)
    start.add_argument("--insecure", action="store_true",
                       help="no authentication and no ACLs: any client may write any topic (quick local work only)")
    start.add_argument("--tls", action="store_true",
                       help="SASL_SSL listeners: a local CA and broker certificate are generated on first start "
                            "into <data-dir>/tls/; clients trust <data-dir>/tls/ca.pem (kafka.ssl_cafile)")
    for name, help_text in (("stop", "stop the brokers started from --data-dir"),
                            ("status", "show nodes, pids and whether they answer")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)


INSECURE_WARNING = ("rollway broker: WARNING: --insecure: no authentication, no ACLs; anyone who reaches the "
                    "port can write rewards, train steps and weights")


def secure_cluster_setup(args: argparse.Namespace, bootstrap: str, credentials_file: str, ca_file: str = "") -> None:
    """As admin: the config's topics, the users and the ACL table (bus/acl.py)."""
    from rollway.commands import load_config_or_exit
    from rollway.commands.acl import secure_setup

    cfg = load_config_or_exit(args, "broker")
    cfg.kafka.bootstrap_servers = bootstrap
    cfg.kafka.credentials_file = credentials_file
    cfg.kafka.ssl_cafile = ca_file
    cfg.kafka.security_protocol = "SASL_SSL" if ca_file else "SASL_PLAINTEXT"
    cfg.kafka.role = "admin"
    secure_setup(cfg)


def run(args: argparse.Namespace) -> int:
    import sys

    from rollway.broker import (
        BrokerError, ClusterState, LocalKafka, external_bootstrap, metadata_brokers, pid_alive,
        stop_cluster,
    )
    from rollway.logging import configure_logging

    configure_logging("broker")
    # stop/status act on the brokers of --data-dir whatever KAFKA_BOOTSTRAP_SERVERS says:
    # after `export KAFKA_BOOTSTRAP_SERVERS=...` (as start suggests), stop must still stop
    # them. start defers to a variable naming another cluster, not to one naming the
    # cluster of --data-dir (start, export, stop, start again).
    external = external_bootstrap()
    try:
        if args.action == "start" and external:
            # The brokers this command would start (--port P: nodes on P, P+2, P+4).
            planned = {",".join(f"127.0.0.1:{args.port + 2 * i}" for i in range(args.nodes))} if args.port else set()
            try:
                planned.add(ClusterState.load(args.data_dir).bootstrap)
            except BrokerError:
                pass
            ours = external in planned
            if not ours:
                print(f"KAFKA_BOOTSTRAP_SERVERS={external} is set: using that cluster, starting nothing "
                      f"(unset it to start one from {args.data_dir})")
                return 0
        if args.action == "start":
            try:
                state = ClusterState.load(args.data_dir)
                if any(pid_alive(n.pid) for n in state.nodes):
                    print(f"already running: {state.bootstrap} (rollway broker stop --data-dir {args.data_dir})")
                    return 1
            except BrokerError:
                pass
            ports = None
            if args.port:
                ports = list(range(args.port, args.port + 2 * args.nodes))
            if args.insecure and args.tls:
                print("rollway broker: --tls comes with SASL/SCRAM and ACLs; drop --insecure", file=sys.stderr)
                return 2
            if args.insecure:
                print(INSECURE_WARNING, file=sys.stderr)
            kafka = LocalKafka(args.data_dir, nodes=args.nodes, ports=ports, heap=args.heap, secure=not args.insecure,
                               tls=args.tls)
            try:
                bootstrap = kafka.start(timeout=args.timeout)
                if not args.insecure:
                    secure_cluster_setup(args, bootstrap, kafka.state.credentials_file, kafka.state.ca_file)
            except BaseException:
                kafka.stop()
                raise
            mode = "" if args.insecure else (" (SASL_SSL: TLS + SCRAM, ACLs on)" if args.tls
                                             else " (SASL/SCRAM, ACLs on)")
            print(f"kafka ready: {bootstrap}{mode}")
            print(f"export KAFKA_BOOTSTRAP_SERVERS={bootstrap}")
            if not args.insecure:
                print(f"export ROLLWAY_KAFKA__CREDENTIALS_FILE={kafka.state.credentials_file}")
            if args.tls:
                print(f"export ROLLWAY_KAFKA__SSL_CAFILE={kafka.state.ca_file}")
            return 0
        state = ClusterState.load(args.data_dir)
        if args.action == "stop":
            pids = stop_cluster(state)
            print(f"stopped pids {pids}" if pids else "nothing was running")
            return 0
        for node in state.nodes:
            alive = "running" if pid_alive(node.pid) else "dead"
            print(f"node {node.node_id}: pid {node.pid} {alive}, port {node.port}, log {node.log_file}")
        try:
            print(f"brokers answering: {metadata_brokers(state.bootstrap, security=state.admin_security())}")
        except Exception as exc:
            print(f"not answering: {exc}")
            return 1
        return 0
    except BrokerError as exc:
        print(f"rollway broker: {exc}", file=sys.stderr)
        return 1
