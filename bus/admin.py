"""Topic administration: create the registry's topics, describe offsets and lag."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, TopicAuthorizationFailedError

from bus.clients import cluster_metadata, new_consumer
from bus.config import KafkaConfig
from bus.connect import start_client, stop_consumer
from bus.security import NotAuthorized, client_security, who
from bus.topics import TOPICS, TopicSpec

log = structlog.get_logger(__name__)

TOPIC_ALREADY_EXISTS = TopicAlreadyExistsError.errno
TOPIC_AUTHORIZATION_FAILED = TopicAuthorizationFailedError.errno


def admin_client(cfg: KafkaConfig) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(
        bootstrap_servers=cfg.bootstrap_servers,
        client_id=f"{cfg.client_id}-admin",
        request_timeout_ms=cfg.request_timeout_ms,
        **client_security(cfg),
    )


async def ensure_topics(
    cfg: KafkaConfig,
    specs: list[TopicSpec] | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """Create every topic of ``specs`` (default: the whole registry) under the configured
    prefix if missing, and wait until each has a leader. Idempotent. Returns the names."""
    specs = list(TOPICS.values()) if specs is None else specs
    names = [s.name(cfg.topic_prefix) for s in specs]
    admin = admin_client(cfg)
    await start_client(admin, cfg.bootstrap_servers, "admin")
    try:
        # Only what is missing: on a secured bus only the admin may create topics, and a
        # component starting against an existing set must not need that right.
        existing = set(await admin.list_topics())
        specs = [s for s in specs if s.name(cfg.topic_prefix) not in existing]
        replication = cfg.replication_factor
        if specs and replication <= 0:
            # aiokafka needs an explicit factor: 3 where the cluster has 3 brokers, else 1.
            brokers = (await admin.describe_cluster())["brokers"]
            replication = 3 if len(brokers) >= 3 else 1
        new = [
            NewTopic(
                name=s.name(cfg.topic_prefix),
                num_partitions=cfg.partitions.get(s.short_name, s.partitions),
                replication_factor=replication,
                topic_configs=dict(s.config),
            )
            for s in specs
        ]
        response = await admin.create_topics(new, timeout_ms=int(timeout * 1000)) if new else None
        for name, code, *rest in response.topic_errors if response else ():
            if code == TOPIC_AUTHORIZATION_FAILED:
                raise NotAuthorized(f"kafka: {who()} may not CREATE topic {name}; create the topics as admin "
                                    "(rollway topics --create, rollway up) or run rollway acl apply")
            if code not in (0, TOPIC_ALREADY_EXISTS):
                message = rest[0] if rest else ""
                raise RuntimeError(f"cannot create topic {name}: error {code} {message}")
    finally:
        await admin.close()
    await wait_for_leaders(cfg, names, timeout)
    return names


async def wait_for_leaders(cfg: KafkaConfig, topics: list[str], timeout: float = 30.0) -> None:
    """Block until the cluster reports a leader for every partition of ``topics``."""
    consumer = new_consumer(cfg, f"{cfg.client_id}-meta")
    await start_client(consumer, cfg.bootstrap_servers, "metadata")
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            meta = await cluster_metadata(consumer)
            missing = [
                t for t in topics
                if not meta.partitions_for_topic(t)
                or any(meta.leader_for_partition(TopicPartition(t, p)) in (None, -1)
                       for p in meta.partitions_for_topic(t))
            ]
            if not missing:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"topics without leaders after {timeout}s: {missing}")
            await asyncio.sleep(0.2)
    finally:
        await stop_consumer(consumer)


@dataclass
class PartitionInfo:
    partition: int
    begin_offset: int
    end_offset: int
    committed: dict[str, int] = field(default_factory=dict)  # group -> committed offset

    def lag(self, group: str) -> int | None:
        committed = self.committed.get(group)
        return None if committed is None else max(self.end_offset - committed, 0)


@dataclass
class TopicInfo:
    name: str
    partitions: list[PartitionInfo]

    @property
    def records(self) -> int:
        return sum(p.end_offset - p.begin_offset for p in self.partitions)


async def list_rollway_topics(cfg: KafkaConfig) -> list[str]:
    admin = admin_client(cfg)
    await start_client(admin, cfg.bootstrap_servers, "admin")
    try:
        names = await admin.list_topics()
    finally:
        await admin.close()
    return sorted(n for n in names if n.startswith(cfg.topic_prefix))


async def describe_topics(cfg: KafkaConfig, topics: list[str], groups: list[str] | None = None) -> list[TopicInfo]:
    """Partitions, begin/end offsets and, per consumer group, committed offsets."""
    admin = admin_client(cfg)
    consumer = new_consumer(cfg, f"{cfg.client_id}-describe")
    await start_client(admin, cfg.bootstrap_servers, "admin")
    try:
        await start_client(consumer, cfg.bootstrap_servers, "metadata")
    except BaseException:
        await admin.close()
        raise
    try:
        cluster = await cluster_metadata(consumer)
        tps = [TopicPartition(t, p) for t in topics for p in sorted(cluster.partitions_for_topic(t) or ())]
        begins = await consumer.beginning_offsets(tps) if tps else {}
        ends = await consumer.end_offsets(tps) if tps else {}
        if groups is None:
            groups = [g[0] if isinstance(g, tuple) else g.group_id for g in await admin.list_consumer_groups()]
        committed: dict[str, dict[TopicPartition, int]] = {}
        for group in groups:
            offsets = await admin.list_consumer_group_offsets(group)
            relevant = {tp: om.offset for tp, om in offsets.items() if tp.topic in topics and om.offset >= 0}
            if relevant:
                committed[group] = relevant
        infos = []
        for topic in topics:
            parts = [
                PartitionInfo(
                    partition=tp.partition,
                    begin_offset=begins[tp],
                    end_offset=ends[tp],
                    committed={g: offs[tp] for g, offs in committed.items() if tp in offs},
                )
                for tp in tps if tp.topic == topic
            ]
            infos.append(TopicInfo(topic, parts))
        return infos
    finally:
        await stop_consumer(consumer)
        await admin.close()
