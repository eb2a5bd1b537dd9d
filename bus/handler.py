"""What a user consumer is: its topics, the event types its handler takes, its hooks.

The handler's first parameter's annotation selects the events it gets: ``Reward``,
``Reward | TrajectoryChunk``, ``list[Reward]`` for a batch handler; no annotation (or
``Event``) takes every event of its topics. Records of other types are skipped (acked
and counted), so a handler never checks ``isinstance`` to filter.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import types
import typing
from typing import Any, Awaitable, Callable, Sequence

from bus.consumer import Envelope
from bus.policy import ErrorPolicy
from bus.topics import TOPICS
from schemas import EVENT_TYPES, Event


class ConsumerError(ValueError):
    """A consumer that cannot work as declared (unknown topic, wrong annotation)."""


Hook = Callable[[], Any]


class Analytics:
    """Base class of a user consumer: set ``topics`` and override ``handle``.

    ``group=None`` (the default) joins no consumer group and commits nothing: with
    ``from_beginning`` it reads every topic from its beginning on each start, so state
    kept in memory is rebuilt from the log (the system of record) before going live. Give
    a ``group`` to share the work between processes and resume at committed offsets.
    """

    topics: Sequence[str] = ()
    group: str | None = None
    from_beginning: bool = True
    policy: ErrorPolicy = ErrorPolicy()
    batch_size: int | None = None  # set: handle(events: list[T], envs: list[Envelope])
    batch_wait_s: float = 1.0  # a partial batch is handled after this long

    async def on_start(self) -> None:
        """Before the first record."""

    async def on_caught_up(self) -> None:
        """Once every record that was in the topics at start has been handled."""

    async def handle(self, event: Any, env: Envelope) -> None:
        raise NotImplementedError

    async def on_stop(self) -> None:
        """After the last record (also when stopping on an error): flush, report."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def accepted_types(self) -> tuple[type[Event], ...]:
        return accepted_types(self.handle, batch=self.batch_size is not None, owner=self.name)

    async def call(self, events: Any, envs: Any) -> None:
        """Run the handler (one event or a batch)."""
        await self.handle(events, envs)

    async def run_hook(self, name: str) -> None:
        await getattr(self, name)()


class FunctionConsumer(Analytics):
    """``@consumer`` turns an async function into this. It stays callable as the
    function it wraps (tests call it directly) and collects hooks by decorator."""

    def __init__(self, fn: Callable[..., Awaitable[None]], topics: Sequence[str], group: str | None,
                 from_beginning: bool, policy: ErrorPolicy, batch_size: int | None, batch_wait_s: float) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.topics = list(topics)
        self.group = group
        self.from_beginning = from_beginning
        self.policy = policy
        self.batch_size = batch_size
        self.batch_wait_s = batch_wait_s
        self._hooks: dict[str, list[Hook]] = {"on_start": [], "on_caught_up": [], "on_stop": []}
        # One-parameter handlers (``async def f(reward: Reward)``) do not get the envelope.
        self._wants_env = len(inspect.signature(fn).parameters) >= 2

    def __call__(self, *args: Any, **kwargs: Any) -> Awaitable[None]:
        return self.fn(*args, **kwargs)

    @property
    def name(self) -> str:
        return self.fn.__name__

    def accepted_types(self) -> tuple[type[Event], ...]:
        return accepted_types(self.fn, batch=self.batch_size is not None, owner=self.name)

    async def call(self, events: Any, envs: Any) -> None:
        await (self.fn(events, envs) if self._wants_env else self.fn(events))

    def on_start(self, hook: Hook) -> Hook:  # type: ignore[override]
        """Register ``hook`` (sync or async, no arguments) to run before the first record."""
        self._hooks["on_start"].append(hook)
        return hook

    def on_caught_up(self, hook: Hook) -> Hook:  # type: ignore[override]
        """Register ``hook`` to run once the records present at start are handled."""
        self._hooks["on_caught_up"].append(hook)
        return hook

    def on_stop(self, hook: Hook) -> Hook:  # type: ignore[override]
        """Register ``hook`` to run after the last record."""
        self._hooks["on_stop"].append(hook)
        return hook

    async def run_hook(self, name: str) -> None:
        for hook in self._hooks[name]:
            result = hook()
            if inspect.isawaitable(result):
                await result


def consumer(
    *topics: str,
    group: str | None = None,
    from_beginning: bool = True,
    policy: ErrorPolicy | None = None,
    batch_size: int | None = None,
    batch_wait_s: float = 1.0,
) -> Callable[[Callable[..., Awaitable[None]]], FunctionConsumer]:
    """Turn ``async def f(event: T, env)`` into a consumer of ``topics`` (short names).

    ``group``/``from_beginning``: see :class:`Analytics`. ``policy``: what errors do
    (:class:`bus.policy.ErrorPolicy`). ``batch_size``: the handler takes
    ``(events: list[T], envs: list[Envelope])``, at most ``batch_size`` at a time, a
    partial batch after ``batch_wait_s``.
    """
    if not topics:
        raise ConsumerError("@consumer needs at least one topic, e.g. @consumer('rewards')")
    if batch_size is not None and batch_size < 1:
        raise ConsumerError(f"@consumer(batch_size={batch_size}): must be 1 or more")

    def wrap(fn: Callable[..., Awaitable[None]]) -> FunctionConsumer:
        if not asyncio.iscoroutinefunction(fn):
            raise TypeError(f"@consumer needs an async function, {fn!r} is not")
        made = FunctionConsumer(fn, topics, group, from_beginning, policy or ErrorPolicy(), batch_size,
                                batch_wait_s)
        validate(made)
        return made

    return wrap


def validate(app: Analytics) -> tuple[type[Event], ...]:
    """Check topics and annotation; the event types the handler takes. Raises ConsumerError."""
    if not app.topics:
        raise ConsumerError(f"{app.name} has no topics")
    carried = [topic_event_type(topic, app.name) for topic in app.topics]
    accepted = app.accepted_types()
    for topic, event_type in zip(app.topics, carried):
        if not issubclass(event_type, accepted):
            takes = " | ".join(t.__name__ for t in accepted)
            raise ConsumerError(f"{app.name} takes {takes}, but topic {topic!r} carries {event_type.__name__}")
    return accepted


def topic_event_type(topic: str, owner: str) -> type[Event]:
    short = topic.split(".", 1)[1] if topic.startswith("rollway.") else topic
    spec = TOPICS.get(short)
    if spec is None:
        near = difflib.get_close_matches(short, list(TOPICS), n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConsumerError(f"{owner}: unknown topic {topic!r}{hint}; topics: {', '.join(TOPICS)}")
    return spec.event_type


def accepted_types(fn: Callable[..., Any], *, batch: bool, owner: str) -> tuple[type[Event], ...]:
    """The event types named by the annotation of ``fn``'s first parameter."""
    params = [p for p in inspect.signature(fn).parameters.values()]
    if not params:
        raise ConsumerError(f"{owner} must take the event as its first parameter")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:  # an annotation naming something not importable
        raise ConsumerError(f"{owner}: cannot resolve its annotations ({exc})") from None
    annotation = hints.get(params[0].name, Any)
    if batch:
        if annotation is not Any and typing.get_origin(annotation) not in (list, Sequence, typing.Sequence):
            raise ConsumerError(f"{owner} is a batch consumer: annotate its first parameter list[EventType]")
        args = typing.get_args(annotation)
        annotation = args[0] if args else Any
    return _event_types_of(annotation, owner)


def _event_types_of(annotation: Any, owner: str) -> tuple[type[Event], ...]:
    if annotation is Any or annotation is Event:
        return (Event,)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        out: tuple[type[Event], ...] = ()
        for arg in typing.get_args(annotation):
            out += _event_types_of(arg, owner)
        return out
    if isinstance(annotation, type) and issubclass(annotation, Event):
        return (annotation,)
    known = ", ".join(EVENT_TYPES)
    raise ConsumerError(f"{owner}: its event annotation {annotation!r} is not an event type ({known})")
