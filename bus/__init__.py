"""Rollway's Kafka plumbing: topics, producer, consumer, dead letters, readers."""

from bus.admin import describe_topics, ensure_topics, list_rollway_topics
from bus.codec import DecodeFailure, decode, encode
from bus.config import KafkaConfig
from bus.connect import KafkaUnreachable, wait_for_broker
from bus.consumer import Envelope, EventConsumer, InvalidEvent
from bus.producer import EventProducer, RecordTooLarge, WriterFenced
from bus.reader import RecordMissing, fetch_records, read_topic
from bus.topics import TOPICS, TopicSpec, spec_for, topic_spec

__all__ = [
    "TOPICS",
    "DecodeFailure",
    "Envelope",
    "EventConsumer",
    "EventProducer",
    "InvalidEvent",
    "KafkaConfig",
    "KafkaUnreachable",
    "RecordMissing",
    "RecordTooLarge",
    "TopicSpec",
    "WriterFenced",
    "decode",
    "describe_topics",
    "encode",
    "ensure_topics",
    "fetch_records",
    "list_rollway_topics",
    "read_topic",
    "spec_for",
    "topic_spec",
    "wait_for_broker",
]
