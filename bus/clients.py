"""Building aiokafka clients, and the only place Rollway touches aiokafka's private API.

Every consumer is built by :func:`new_consumer` (bootstrap address and request timeout
from ``KafkaConfig``; the caller names the client and its group/commit settings) and
started through ``bus.connect.start_client``. aiokafka offers no public call for two
things Rollway needs; each is one function here, so an aiokafka upgrade that moves them
breaks in one place (aiokafka is pinned <0.15 in pyproject.toml):

* :func:`cluster_metadata` — metadata of every topic (the public
  ``partitions_for_topic`` only knows topics the consumer subscribed to);
* :func:`client_user` — the SASL user a client authenticates as (for error lines);
* :func:`client_tls` — the TLS context a client connects with (for bus.tls's check);
* :func:`transaction_manager` — a transactional producer's state: the epoch the broker
  granted it, whether it failed fatally (fenced), its transaction-end waiter;
* :func:`decompress_fetches_ahead` — each fetch response's message sets handed to a
  ``bus.prefetch.BatchPrefetcher`` as they arrive;
* :func:`build_fetched_records_with` — what aiokafka's fetcher builds a partition's
  records object with (``bus.prefetch.memory_records``: the prefetcher's results).
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.cluster import ClusterMetadata
from aiokafka.producer.transaction_manager import TransactionManager

from bus.config import KafkaConfig
from bus.security import client_security


def new_consumer(cfg: KafkaConfig, client_id: str, **settings: Any) -> AIOKafkaConsumer:
    """An unstarted aiokafka consumer of ``cfg``'s cluster; ``settings`` are aiokafka's
    consumer options (group_id, isolation_level, ...)."""
    return AIOKafkaConsumer(
        bootstrap_servers=cfg.bootstrap_servers, client_id=client_id,
        request_timeout_ms=cfg.request_timeout_ms, **client_security(cfg), **settings,
    )


async def cluster_metadata(consumer: AIOKafkaConsumer) -> ClusterMetadata:
    """Fresh metadata of every topic of the cluster (partitions, leaders), fetched now
    through the started ``consumer``'s connection. Private API: ``consumer._client``."""
    return await consumer._client.fetch_all_metadata()


async def fetch_committed(consumer: AIOKafkaConsumer, partitions) -> dict:
    """The group's committed ``OffsetAndMetadata`` of each of ``partitions`` (None where
    nothing is committed): ``consumer.committed`` returns the offset without its
    metadata. Private API: ``consumer._coordinator.fetch_committed_offsets``."""
    return await consumer._coordinator.fetch_committed_offsets(list(partitions))


def group_generation(consumer: AIOKafkaConsumer) -> int:
    """The consumer group generation this member is in (-1 when it is in none: not joined
    yet, left, or reset after the coordinator no longer knew it). Private API:
    ``consumer._coordinator.generation``."""
    coordinator = getattr(consumer, "_coordinator", None)
    return -1 if coordinator is None else coordinator.generation


def transaction_manager(producer: AIOKafkaProducer) -> TransactionManager | None:
    """The transaction state of a producer (None for one without a transactional id).
    Private API: ``producer._txn_manager``."""
    return producer._txn_manager


def client_user(client: Any) -> str | None:
    """The SASL user name an aiokafka producer, consumer or admin client logs in with
    (None without SASL). Private API: the consumer's and admin's ``_client``, the
    producer's ``client``, and its ``_sasl_plain_username``."""
    inner = getattr(client, "_client", None) or getattr(client, "client", None)
    return getattr(inner, "_sasl_plain_username", None)


def client_tls(client: Any):
    """The ``ssl.SSLContext`` an aiokafka client connects with, None without TLS.
    Private API: as :func:`client_user`, and ``_security_protocol``/``_ssl_context``."""
    inner = getattr(client, "_client", None) or getattr(client, "client", None)
    if getattr(inner, "_security_protocol", "PLAINTEXT") not in ("SSL", "SASL_SSL"):
        return None
    return getattr(inner, "_ssl_context", None)


def decompress_fetches_ahead(consumer: AIOKafkaConsumer, prefetcher: Any) -> None:
    """Hand every partition's message set of ``consumer``'s fetch responses to
    ``prefetcher.add(topic, partition, message_set)`` as the response arrives, before
    aiokafka's fetcher stores it (the response itself is not changed). Private API: the
    consumer's ``_client.send`` (wrapped on this instance only), the Fetch request's
    ``API_KEY`` and the response's ``topics`` layout that aiokafka's fetcher reads
    (``partition, error_code, highwater, *part_data`` with the message set last)."""
    client = consumer._client
    send = client.send

    async def send_and_prefetch(node_id, request, *args, **kwargs):
        response = await send(node_id, request, *args, **kwargs)
        if getattr(request, "API_KEY", None) == 1 and response is not None:  # Fetch
            for topic, partitions in response.topics:
                for partition, error_code, _highwater, *part_data in partitions:
                    if error_code == 0 and part_data:
                        prefetcher.add(topic, partition, part_data[-1])
        return response

    client.send = send_and_prefetch


def build_fetched_records_with(factory: Any) -> None:
    """Make aiokafka's fetcher build each partition's records object with
    ``factory(message_set)`` instead of ``MemoryRecords(message_set)`` (the factory
    returns one, or a stand-in with its ``has_next``, ``next_batch`` and
    ``size_in_bytes``). Process-wide and idempotent; raises if aiokafka's fetcher no
    longer builds them with ``MemoryRecords``. Private API: the fetcher module's
    ``MemoryRecords`` global, read by ``Fetcher._proc_fetch_request``."""
    import aiokafka.consumer.fetcher as fetcher
    from aiokafka.record.memory_records import MemoryRecords

    if fetcher.MemoryRecords is factory:
        return
    if fetcher.MemoryRecords is not MemoryRecords:
        raise RuntimeError("aiokafka.consumer.fetcher.MemoryRecords is not aiokafka's MemoryRecords: "
                           "aiokafka changed, check bus/clients.py and bus/prefetch.py")
    fetcher.MemoryRecords = factory
