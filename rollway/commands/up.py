"""``rollway up``: the whole main job as supervised local processes, with a live view.

Starts a local Kafka broker unless ``KAFKA_BOOTSTRAP_SERVERS`` is set, creates the
topics, builds the warm-start model where the config points at a missing one, then runs
the sandbox, feeder, N samplers, trainer, evaluator and the solve-rate analytics as
child processes, each logging JSON to ``<log-dir>/<name>.log`` (``rollway up``'s own log
is ``<log-dir>/up.log``).

* Supervision (:mod:`rollway.supervisor`): a component that exits or is killed is
  started again after an exponential backoff; a crash loop (``up.restart``) stops the
  stack with exit code 1, naming the component and its log.
* The view (:mod:`rollway.live_state`, :mod:`rollway.live_view`): read from the log
  (metrics, health, rewards, evals, dlq) and refreshed each second; a ``rich`` table on
  a terminal, one status line every few seconds with ``--no-tui`` or when stdout is not
  a terminal.
* Stopping: Ctrl-C, SIGTERM, ``--steps N`` (the trainer stops after step N) or
  ``--minutes M``. Components get SIGTERM in order (feeder, samplers and evaluator
  drain first, then trainer and analytics, then the sandbox), SIGKILL after the grace
  period; then the broker it started stops.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

COMPONENTS = ("sandbox", "feeder", "sampler", "trainer", "evaluator", "analytics")
# The main job's settings where they differ from the components' defaults (which suit
# the demo tasks and the tests): what `rollway up` sets for each key that neither the
# config file nor the environment names. deploy/rollway.compose.toml carries the same
# values (tests/test_up.py checks it), so compose runs the same job.
MAIN_JOB: dict[tuple[str, str], str] = {
    # the learnable task family's train split (the grader resolves its ids too)
    ("feeder", "tasks_dir"): "family:train",
    # RL on the ~1.5M-parameter warm start: the defaults (1e-5, for large models) would
    # not move it within a 30-minute CPU run, and 1e-3 (Muon's orthogonalised updates
    # amplify the noise of 4-group batches) made held-out pass@1 fall from 28% to 10% in
    # 15 steps; docs/results.md has the runs and the offline sweep behind 2e-4.
    ("trainer", "learning_rate"): "2e-4",
    ("trainer", "muon_learning_rate"): "2e-4",
    # The chatml-hermes warm start's prompt alone is ~520 tokens (the tool schemas): at the
    # components' 1,024 a segment compacts after two or three turns.
    ("sampler", "max_model_len"): "2048",
    # Which tasks the feeder draws (issue #30; docs/results.md, "Selection for a learning
    # signal"): groups of 8, each task weighted by the chance its group is informative,
    # solve rates pooled kind -> skill -> task with a light task prior, sharpened hard,
    # every kind at least 5% of the draws. Seed 0, same warm start: 0.513 of sampled
    # groups informative (0.257 with the components' selection), 7.55 trained groups a
    # minute (6.68), held-out pass@1 +31.5 / +28.5 / +28.5 (+31.0 / +28.0 / +26.5).
    ("feeder", "group_size"): "8",
    ("feeder", "selection_weight"): "informative",
    ("feeder", "pool_by_skill_window"): "64",
    ("feeder", "selection_temperature"): "0.05",
    ("feeder", "selection_kind_floor"): "0.05",
    ("feeder", "prior_successes"): "0.25",
    ("feeder", "prior_failures"): "0.25",
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samplers", type=int, help="sampler replicas (default: up.samplers)")
    parser.add_argument("--log-dir", help="component logs (default: up.log_dir, var/logs)")
    parser.add_argument("--kafka-dir", help="local broker data (default: up.kafka_dir, var/kafka)")
    parser.add_argument("--without", action="append", default=[], choices=COMPONENTS,
                        help="leave a component out (repeatable)")
    parser.add_argument("--grace", type=float, help="seconds to wait after SIGTERM (default: up.grace_s)")
    parser.add_argument("--steps", type=int, help="stop the stack after this many train steps in total")
    parser.add_argument("--minutes", type=float, help="stop the stack after this many minutes")
    parser.add_argument("--insecure", action="store_true",
                        help="start the local broker without authentication and ACLs, and the sandbox API "
                             "without tokens (quick local work only)")
    parser.add_argument("--no-tui", action="store_true",
                        help="line output (a status line every up.status_every_s seconds) instead of the live "
                             "view; implied when stdout is not a terminal")


@dataclass(frozen=True)
class Planned:
    name: str
    kind: str  # one of COMPONENTS
    argv: list[str]  # rollway arguments
    env: dict[str, str] = field(default_factory=dict)
    stop_stage: int = 0
    done_on_success: bool = False


def available_commands() -> set[str]:
    from rollway.cli import COMMANDS

    return {name for name, _module, _help in COMMANDS}


def plan(samplers: int, without: list[str], *, max_steps: int | None = None,
         commands: set[str] | None = None) -> list[Planned]:
    """Every child process, in start order. A component whose command this install does
    not have (yet) is left out."""
    commands = available_commands() if commands is None else commands
    procs: list[Planned] = []

    def want(kind: str) -> bool:
        return kind not in without and kind in commands

    if want("sandbox"):
        procs.append(Planned("sandbox", "sandbox", ["sandbox"], stop_stage=2))
    if want("trainer"):
        argv = ["trainer"] + ([] if max_steps is None else ["--max-steps", str(max_steps)])
        # With --steps the trainer's exit 0 means "step N reached", not a crash.
        procs.append(Planned("trainer", "trainer", argv, stop_stage=1, done_on_success=max_steps is not None))
    if want("sampler"):
        for i in range(samplers):
            procs.append(Planned(f"sampler-{i}", "sampler", ["sampler"], {"ROLLWAY_REPLICA_ID": f"sampler-{i}"}))
    if want("evaluator"):
        procs.append(Planned("evaluator", "evaluator", ["evaluator"], {"ROLLWAY_REPLICA_ID": "evaluator"}))
    if want("feeder"):
        procs.append(Planned("feeder", "feeder", ["feeder"]))
    if want("analytics"):
        procs.append(Planned("analytics", "analytics", ["analytics", "solve-rate"], stop_stage=1))
    return procs


def model_paths(cfg, kinds: set[str]) -> list[str]:
    """The model folders the planned components load (samplers and the evaluator the
    sampler's, the trainer its own)."""
    paths = set()
    if kinds & {"sampler", "evaluator"}:
        paths.add(cfg.sampler.model_path)
    if "trainer" in kinds:
        paths.add(cfg.trainer.model_path)
    return sorted(paths)


def needs_model_init(path: str) -> bool:
    """A folder without a model, or one holding a warm start built from outdated
    sources (``rollway model init`` replaces that copy). A model of the user's own (no
    warm-start marker) and a current warm start are left alone, without a subprocess."""
    from pathlib import Path

    from trainer.warm_start import MARKER, is_outdated

    if not Path(path, "config.json").exists():
        return True
    return Path(path, MARKER).exists() and is_outdated(path)


def model_command(path: str, sampler_format: str = "auto") -> list[str]:
    """The warm start (``rollway model init``: SFT on the family's train split), copied to
    ``path``, in the sampler's format where init can build it (``auto``: the format of the
    warm start ``path`` held, else init's default).

    An outdated warm start is rebuilt with the settings its marker records (seed, SFT
    steps, premature-submit rate), not with init's defaults: a 2,000-step warm start
    made by hand must not come back from a source edit as a 500-step one."""
    from trainer.warm_start import FORMATS  # the sampler.format names init builds

    argv = ["model", "init", "--out", path]
    recorded = _recorded_warm_start(path)
    if recorded is not None:
        if recorded.seed == recorded.sft.seed:  # init's --seed sets both
            argv += ["--seed", str(recorded.seed)]
        argv += ["--steps", str(recorded.sft.steps),
                 "--premature-submit-rate", repr(recorded.sft.premature_submit_rate)]
    if sampler_format in FORMATS:
        argv += ["--format", sampler_format]
    elif recorded is not None:
        argv += ["--format", recorded.format]
    return argv


def _recorded_warm_start(path: str):
    """The WarmStartConfig the warm start in ``path`` was built with; None for a folder
    without a marker, or a marker this version cannot read (init's defaults then)."""
    import json
    from pathlib import Path

    import msgspec

    from trainer.warm_start import MARKER, WarmStartConfig

    try:
        return msgspec.convert(json.loads(Path(path, MARKER).read_text())["config"], WarmStartConfig)
    except (OSError, ValueError, KeyError, TypeError, msgspec.ValidationError):
        return None


def run(args: argparse.Namespace) -> int:
    import os
    import sys
    from pathlib import Path

    from rollway.commands import given, load_config_or_exit
    from rollway.config import given_settings
    from rollway.logging import configure_logging

    cfg = load_config_or_exit(args, "up", {"up": given(
        samplers=args.samplers, log_dir=args.log_dir, kafka_dir=args.kafka_dir, grace_s=args.grace)})
    upcfg = cfg.up
    if args.steps is not None and (args.steps < 1 or "trainer" in args.without):
        print("rollway up: --steps needs a positive number and the trainer", file=sys.stderr)
        return 2
    if args.minutes is not None and args.minutes <= 0:
        print("rollway up: --minutes must be positive", file=sys.stderr)
        return 2
    log_dir = Path(upcfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # up's JSON log goes to a file: stdout belongs to the view, stderr to one-line errors.
    up_log = open(log_dir / "up.log", "a", buffering=1)
    configure_logging("up", level=cfg.logging.level, stream=up_log)
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at run time
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.config:
        env["ROLLWAY_CONFIG"] = str(Path(args.config).resolve())
    given = given_settings(args.config, env)
    for (section, key), value in MAIN_JOB.items():
        if key not in given.get(section, {}):
            env[f"ROLLWAY_{section.upper()}__{key.upper()}"] = value
    try:
        return _run(args, cfg, upcfg, env, log_dir)
    finally:
        up_log.close()


def _run(args, cfg, upcfg, env: dict[str, str], log_dir) -> int:
    import asyncio
    import signal
    import sys

    import structlog

    from bus.admin import ensure_topics
    from rollway.broker import BrokerError, LocalKafka, external_bootstrap
    from rollway.supervisor import ComponentSpec, Supervisor

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    # Until the components run, SIGTERM acts like Ctrl-C, so the `finally` below still
    # stops a broker this command started.
    signal.signal(signal.SIGTERM, interrupt)
    log = structlog.get_logger("rollway.up")
    procs = plan(upcfg.samplers, args.without, max_steps=args.steps)
    kafka = None
    sup: Supervisor | None = None
    try:
        bootstrap = external_bootstrap()
        secure = False
        if bootstrap is None:
            secure = not args.insecure
            print(f"rollway up: starting Kafka (data in {upcfg.kafka_dir}"
                  f"{', SASL/SCRAM and ACLs' if secure else ''})", flush=True)
            if not secure:
                from rollway.commands.broker import INSECURE_WARNING

                print(INSECURE_WARNING.replace("rollway broker", "rollway up"), file=sys.stderr, flush=True)
            kafka = LocalKafka(upcfg.kafka_dir, nodes=1, secure=secure)
            bootstrap = kafka.start()
        env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
        cfg.kafka.bootstrap_servers = bootstrap
        if secure:
            # Each component authenticates as its own role (rollway.commands.acl) from
            # this file; the sandbox API's tokens are in it too.
            env["ROLLWAY_KAFKA__CREDENTIALS_FILE"] = cfg.kafka.credentials_file = kafka.state.credentials_file
        from bus.security import security_protocol

        if security_protocol(cfg.kafka) != "PLAINTEXT":
            from rollway.commands.acl import secure_setup

            secure_setup(cfg)  # as admin: topics, users and the ACL table of this config
        else:
            asyncio.run(ensure_topics(cfg.kafka))
        if not _build_models(model_paths(cfg, {p.kind for p in procs}), cfg.sampler.format, env, log_dir):
            return 1
        specs = [ComponentSpec(name=p.name, argv=[sys.executable, "-m", "rollway.cli", *p.argv],
                               env={**env, **p.env}, log_path=log_dir / f"{p.name}.log",
                               stop_stage=p.stop_stage, done_on_success=p.done_on_success) for p in procs]
        sup = Supervisor(specs, upcfg.restart)
        tui = not args.no_tui and sys.stdout.isatty()
        tasks = env.get("ROLLWAY_FEEDER__TASKS_DIR", cfg.feeder.tasks_dir)
        print(f"rollway up: {len(specs)} components ({', '.join(p.name for p in procs)}), training on {tasks}, "
              f"Kafka at {bootstrap}, logs in {log_dir}/ (Ctrl-C stops)", flush=True)
        from rollway.up_loop import UpLoop

        loop = UpLoop(cfg, upcfg, sup, tui=tui, steps=args.steps, minutes=args.minutes)
        code, reason = asyncio.run(loop.run())
        log.info("stopping", reason=reason, exit_code=code)
        print(f"rollway up: {reason}; stopping components (grace {upcfg.grace_s:g} s)", flush=True,
              file=sys.stderr if code else sys.stdout)
        _stop(sup, upcfg.grace_s)
        sup = None
        print(f"rollway up: stopped ({loop.summary()})", flush=True)
        return code
    except BrokerError as exc:
        print(f"rollway up: {exc}", file=sys.stderr)
        return 1
    finally:
        if sup is not None:  # an error above: no child may outlive `rollway up`
            _stop(sup, upcfg.grace_s)
        if kafka is not None:
            kafka.stop()


def _build_models(paths: list[str], sampler_format: str, env: dict[str, str], log_dir) -> bool:
    """Build each model folder that needs it (``rollway model init``, logged to
    ``model.log``); False, after one line on stderr, when a build failed."""
    import subprocess
    import sys

    for path in paths:
        if not needs_model_init(path):
            continue
        argv = model_command(path, sampler_format)
        print(f"rollway up: building the model: rollway {' '.join(argv)} (log: {log_dir}/model.log)", flush=True)
        with open(log_dir / "model.log", "ab") as out:
            done = subprocess.run([sys.executable, "-m", "rollway.cli", *argv], env=env, stdout=out,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            print(f"rollway up: building the model failed (exit {done.returncode}); see {log_dir}/model.log",
                  file=sys.stderr)
            return False
    return True


def _stop(sup, grace_s: float) -> None:
    """Graceful stop; SIGTERM is ignored meanwhile (we are stopping already), a Ctrl-C
    kills what is left at once."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        sup.stop(grace_s)
    except KeyboardInterrupt:
        sup.kill_all()
        raise
