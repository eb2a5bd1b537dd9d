"""Connecting to Kafka: the one place where every aiokafka client of Rollway starts.

Two policies, chosen per process (``wait_for_broker``):

* services (trainer, sampler, feeder, sandbox, evaluator, analytics) wait: each failed
  attempt logs one line naming the bootstrap address and how to start a broker, then
  retries with exponential backoff, forever — a stack started before its broker comes
  up once the broker does;
* CLI tools (tail, replay, eval, topics, ...) fail fast with ``KafkaUnreachable``, whose
  message is the one line the command prints.

A client whose start failed is stopped before the error leaves (no "Unclosed
AIOKafkaConsumer" warnings at exit), and aiokafka's own per-host bootstrap error line
is dropped: the line logged here says the same with what to do about it. Once
connected, aiokafka itself rides out a broker that goes away (consumers re-fetch, the
producer retries); publishes that still fail are retried by ``EventProducer``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import structlog
from aiokafka.errors import KafkaConnectionError

from bus.clients import client_tls, client_user
from bus.security import NotAuthorized, authentication_failed_message, authorization_errors, denied_message
from bus.tls import TlsMismatch, listener_mismatch

log = structlog.get_logger(__name__)

HINT = "start one with rollway broker start or set KAFKA_BOOTSTRAP_SERVERS"
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 15.0

_wait = False
_stop_requested = False
_sleepers: set[asyncio.Future] = set()


class KafkaUnreachable(Exception):
    """No broker answered at the bootstrap address (CLI tools: print it and exit 1)."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        super().__init__(unreachable_message(bootstrap))


def unreachable_message(bootstrap: str) -> str:
    return f"cannot reach Kafka at {bootstrap} — {HINT}"


def wait_for_broker(enabled: bool = True) -> None:
    """Make this process wait (services) or fail fast (the default: CLI tools)."""
    global _wait
    _wait = enabled


def waiting_for_broker() -> bool:
    return _wait


def stop_waiting() -> None:
    """The process is stopping (SIGTERM): a wait for the broker gives up now, raising
    ``KafkaUnreachable``, instead of outliving the stop request."""
    global _stop_requested
    _stop_requested = True
    for fut in list(_sleepers):
        if not fut.done():
            fut.set_result(None)


def add_stop_handler(loop: asyncio.AbstractEventLoop, sig: int, callback: Any, *args: Any) -> None:
    """``loop.add_signal_handler`` for a service's stop signal that also ends a wait for
    the broker (a service stopped before Kafka came up exits instead of hanging)."""

    def handle() -> None:
        stop_waiting()
        callback(*args)

    loop.add_signal_handler(sig, handle)


def backoff_s(attempt: int) -> float:
    """Delay after the ``attempt``-th failure in a row (1-based)."""
    return min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** (attempt - 1))


async def stop_consumer(consumer: Any) -> None:
    """``await consumer.stop()`` for an aiokafka consumer. Its stop() re-raises the
    CancelledError of its own fetch task when that task was cancelled in a retry backoff
    (after fetches timed out, e.g. in a process that was SIGSTOPped): only a cancellation
    of the calling task may propagate, or it replaces the error being handled (a fenced
    trainer's ``WriterFenced`` became an exit 1 in the chaos run)."""
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("kafka consumer stopped with its fetch task cancelled")


async def start_client(client: Any, bootstrap: str, what: str = "client") -> None:
    """``await client.start()`` under this process's policy. ``client`` is an aiokafka
    producer, consumer or admin client."""
    attempt = 0
    while True:
        attempt += 1
        _auth_failures.clear()
        try:
            await client.start()
            if attempt > 1:
                log.info("kafka reachable", bootstrap=bootstrap, client=what, attempts=attempt)
            return
        except KafkaConnectionError:
            if _auth_failures:
                # Reached, but refused our credentials: retrying cannot help.
                await close_client(client)
                raise NotAuthorized(authentication_failed_message(_auth_failures[-1], client_user(client))) from None
            mismatch = await asyncio.to_thread(listener_mismatch, bootstrap, client_tls(client))
            if mismatch:  # reached, but TLS on one side only or an untrusted certificate
                await close_client(client)
                raise TlsMismatch(mismatch) from None
            if not _wait or _stop_requested:
                await close_client(client)
                raise KafkaUnreachable(bootstrap) from None
        except authorization_errors() as exc:  # a transactional id the ACLs do not grant
            await close_client(client)
            raise NotAuthorized(denied_message(exc, writing=True, user=client_user(client))) from None
        delay = backoff_s(attempt)
        log.warning(f"cannot reach Kafka at {bootstrap}; retrying in {delay:g} s ({HINT})",
                    bootstrap=bootstrap, client=what, attempt=attempt)
        sleeper = asyncio.get_running_loop().create_future()
        _sleepers.add(sleeper)
        try:
            await asyncio.wait_for(sleeper, delay)
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:
            await close_client(client)
            raise
        finally:
            _sleepers.discard(sleeper)
        if _stop_requested:
            await close_client(client)
            raise KafkaUnreachable(bootstrap)


async def close_client(client: Any) -> None:
    """Stop an aiokafka client whatever state its start left it in."""
    try:
        close = getattr(client, "stop", None) or client.close
        await close()
    except Exception:  # already failed; closing is only to release it quietly
        pass


# SASL failures seen during the current start_client attempt (aiokafka only logs them
# and then raises "Unable to bootstrap", as for a broker that is away).
_auth_failures: list[object] = []


class _DropBootstrapErrors(logging.Filter):
    """aiokafka logs ``Unable connect to "host:port"`` at ERROR for each failed bootstrap
    host; ``start_client`` reports the same failure once, with what to do. A failed SASL
    authentication among them is remembered: ``start_client`` then fails at once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith('Unable connect to "')):
            return True
        error = record.args[-1] if isinstance(record.args, tuple) and record.args else None
        if type(error).__name__ in ("SaslAuthenticationFailed", "UnsupportedSaslMechanismError",
                                    "IllegalSaslStateError"):
            _auth_failures.append(error)
        return False


logging.getLogger("aiokafka").addFilter(_DropBootstrapErrors())
