"""Typed configuration: one TOML file, environment overrides, one Struct tree.

Resolution order (later wins):
  1. defaults in the Structs below (and the per-component config modules);
  2. the TOML file: ``--config PATH``, else ``$ROLLWAY_CONFIG``, else ``./rollway.toml``
     when it exists;
  3. environment: ``ROLLWAY_<SECTION>__<FIELD>=value`` (nested with ``__``), e.g.
     ``ROLLWAY_TRAINER__LEARNING_RATE=1e-6``; and ``KAFKA_BOOTSTRAP_SERVERS``, which
     sets ``kafka.bootstrap_servers``;
  4. a command's flags (``overrides``, ``{section: {field: value}}``).

All of them are merged as plain data and converted once (``msgspec.convert``, with
``strict=False``: environment values are strings), so every source is validated the
same way. A bad value is a :class:`ConfigError` of one line naming the key, e.g.
``trainer.stale_policy = 'drop'; expected one of drop_group, mask_tokens``. Allowed
values are ``Literal`` types on the Structs; other rules live in their ``__post_init__``.
"""

from __future__ import annotations

import os
import re
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal, Mapping

import msgspec
import structlog

from bus.config import KafkaConfig
from rollway.supervisor import RestartPolicy
from sampler.config import EvalConfig, SamplerConfig
from sandbox.config import RewardConfig, SandboxConfig
from syncer.config import SyncerConfig
from tasks.config import FeederConfig
from trainer.config import TrainerConfig

log = structlog.get_logger(__name__)


class LoggingConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    level: str = "info"


class UpConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``rollway up``: the stack as supervised local processes (its flags override these)."""

    samplers: int = 2
    log_dir: str = "var/logs"
    kafka_dir: str = "var/kafka"
    # After SIGTERM, how long components may take to drain and checkpoint before SIGKILL.
    grace_s: float = 30.0
    refresh_s: float = 1.0  # live view
    status_every_s: float = 5.0  # --no-tui: one status line this often
    solve_window: int = 200  # rewards in the view's rolling solve rate and reward mean
    restart: RestartPolicy = msgspec.field(default_factory=RestartPolicy)

    def __post_init__(self) -> None:
        if self.samplers < 0 or self.grace_s < 0 or self.refresh_s <= 0 or self.status_every_s <= 0 \
                or self.solve_window < 1:
            raise ValueError("up: need samplers >= 0, grace_s >= 0, refresh_s > 0, status_every_s > 0, "
                             "solve_window >= 1")


# vLLM's names for a dtype (its --dtype choices) -> the published dtype's name; "auto"
# (the model's own dtype) cannot be checked from the config.
_ENGINE_DTYPES = {"bfloat16": "bfloat16", "half": "float16", "float16": "float16", "float": "float32",
                  "float32": "float32"}


class RollwayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_name: str = "rollway-tiny"
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)
    syncer: SyncerConfig = msgspec.field(default_factory=SyncerConfig)
    sampler: SamplerConfig = msgspec.field(default_factory=SamplerConfig)
    sandbox: SandboxConfig = msgspec.field(default_factory=SandboxConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    feeder: FeederConfig = msgspec.field(default_factory=FeederConfig)
    up: UpConfig = msgspec.field(default_factory=UpConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        # Rules across sections (each section checks its own in its __post_init__).
        sandbox, sampler = self.sandbox, self.sampler
        longest_call = sandbox.command_queue_timeout_s + max(sandbox.grading_timeout_s, sampler.tool_timeout_s)
        if sampler.sandbox_request_timeout_s <= longest_call:
            raise ValueError(
                f"sampler.sandbox_request_timeout_s = {sampler.sandbox_request_timeout_s:g} must exceed "
                f"sandbox.command_queue_timeout_s + sandbox.grading_timeout_s = {longest_call:g} s: a submit waits for "
                "a command slot, then for the grading, and a client that gives up first resamples a graded rollout"
            )
        join_wait_s = sampler.revoke_grace_s + sampler.consumer_heartbeat_ms / 1000
        if join_wait_s >= self.kafka.request_timeout_ms / 1000:
            # A replica joining waits in its JoinGroup request while the others finish
            # their revoked groups; aiokafka gives that request kafka.request_timeout_ms.
            raise ValueError(
                f"sampler.revoke_grace_s = {sampler.revoke_grace_s:g} must stay below kafka.request_timeout_ms "
                f"({self.kafka.request_timeout_ms} ms) less a consumer heartbeat ({sampler.consumer_heartbeat_ms} ms): "
                "a replica joining waits that long for the others' revoked groups and would time out")
        if self.feeder.group_size < 2:
            # The trainer drops a group whose rewards are all equal (no advantage signal):
            # a group of one always is, so no step would ever run.
            raise ValueError(f"feeder.group_size = {self.feeder.group_size} cannot train: a group needs at least 2 "
                             "samples for its rewards to differ (the trainer drops groups without reward variance)")
        trainer = self.trainer
        engine_dtype = _ENGINE_DTYPES.get(sampler.dtype)
        if trainer.replay_precision and engine_dtype is not None and engine_dtype != trainer.publish_dtype:
            # It trains, but precision replay then reproduces a precision the samplers do
            # not run: the trainer-sampler mismatch grows instead of shrinking.
            log.warning("precision replay does not match the samplers", sampler_dtype=sampler.dtype,
                        publish_dtype=trainer.publish_dtype,
                        hint="set sampler.dtype = trainer.publish_dtype, or trainer.replay_precision = false")


class ConfigError(ValueError):
    """The configuration file or an environment override is invalid."""


ENV_PREFIX = "ROLLWAY_"
# Environment variables that are not ROLLWAY_<SECTION>__<FIELD> but are honoured
# because every Kafka tool understands them.
ENV_ALIASES = {"KAFKA_BOOTSTRAP_SERVERS": ("kafka", "bootstrap_servers")}


def find_config_file(path: str | os.PathLike[str] | None = None) -> Path | None:
    if path is not None:
        return Path(path)
    env = os.environ.get("ROLLWAY_CONFIG")
    if env:
        return Path(env)
    default = Path("rollway.toml")
    return default if default.exists() else None


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Nested dict of overrides from ``ROLLWAY_A__B=...`` and the aliases."""
    tree: dict[str, Any] = {}

    def put(path: tuple[str, ...], value: str) -> None:
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value

    for name, value in environ.items():
        if name in ENV_ALIASES:
            put(ENV_ALIASES[name], value)
        elif name.startswith(ENV_PREFIX) and "__" in name:
            path = tuple(p.lower() for p in name[len(ENV_PREFIX) :].split("__"))
            if all(path):
                put(path, value)
    return tree


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _coerce_env_strings(tree: Any, template: Any) -> Any:
    """Turn env strings for list/dict fields into values (JSON), leave scalars to msgspec."""
    if isinstance(tree, dict):
        return {
            k: _coerce_env_strings(v, template.get(k) if isinstance(template, dict) else None)
            for k, v in tree.items()
        }
    if isinstance(tree, str) and isinstance(template, (list, dict)):
        try:
            return msgspec.json.decode(tree)
        except msgspec.DecodeError:
            return [s.strip() for s in tree.split(",") if s.strip()] if isinstance(template, list) else tree
    return tree


def _field_type(root: Any, path: str) -> Any:
    """The annotation of the dotted ``path`` (``trainer.device``) under the Struct ``root``, or None."""
    kind = root
    for part in path.split("."):
        if not _is_struct(kind):
            return None
        kind = typing.get_type_hints(kind).get(part)
    return kind


def _is_struct(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, msgspec.Struct)


_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$", re.S)


def describe(exc: msgspec.ValidationError, root: Any = None) -> str:
    """One line naming the key for a ``msgspec.convert(..., root)`` error.

    Errors of ``__post_init__`` already name their keys (``eval.samples must be ...``)
    and are kept; others get the dotted path: ``trainer.device = 'gpu'; expected one of
    auto, cpu, cuda``, ``trainer.groups_per_step: Expected `int`, got `str```, ``unknown
    key trainer.no_such_field``."""
    root = RollwayConfig if root is None else root
    text = str(exc)
    match = _AT.match(text)
    if match is None:
        return text
    what, path = match["what"], match["path"].lstrip(".")
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", what)
    if unknown:
        return f"unknown key {path + '.' if path else ''}{unknown[1]}"
    enum = re.fullmatch(r"Invalid enum value (.*)", what)
    kind = _field_type(root, path) if path else None
    if enum and typing.get_origin(kind) is Literal:
        return f"{path} = {enum[1]}; expected one of {', '.join(map(str, typing.get_args(kind)))}"
    if _is_struct(kind) or not path:
        return what  # raised by __post_init__, which names its keys
    return f"{path}: {what}"


def given_settings(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What the config file and the environment set, nested like the file, without the
    defaults: the layers :func:`load_config` reads (``rollway up`` fills in its main-job
    settings only where neither names them)."""
    _, data, from_env = _read_sources(path, environ)
    return _merge(data, from_env)


def _read_sources(
    path: str | os.PathLike[str] | None, environ: Mapping[str, str] | None,
) -> tuple[Path | None, dict[str, Any], dict[str, Any]]:
    """The config file found (or None), its settings, and the environment's."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    file = find_config_file(path)
    if file is not None:
        try:
            data = tomllib.loads(file.read_text())
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {file}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from exc
    defaults = msgspec.to_builtins(RollwayConfig())
    return file, data, _coerce_env_strings(env_overrides(environ), defaults)


def load_config(
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RollwayConfig:
    """File, then environment, then ``overrides`` (a command's flags, nested like the
    file), merged and converted once."""
    file, data, from_env = _read_sources(path, environ)
    merged = _merge(_merge(data, from_env), overrides or {})
    try:
        return msgspec.convert(merged, RollwayConfig, strict=False)
    except msgspec.ValidationError as exc:
        sources = [f"config file {file}"] if file else []
        sources += ["environment"] if from_env else []
        sources += ["command line"] if overrides else []
        raise ConfigError(f"{describe(exc)} ({' + '.join(sources) or 'defaults'})") from exc
