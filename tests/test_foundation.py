"""Config, logging, the CLI and the broker launcher."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollway.config import ConfigError, load_config
from tests.cli import REPO, run_cli


def test_config_defaults_file_and_env_overrides(tmp_path):
    cfg_file = tmp_path / "rollway.toml"
    cfg_file.write_text('model_name = "m"\n[trainer]\nlearning_rate = 1e-6\ngroups_per_step = 2\n'
                        '[kafka]\nbootstrap_servers = "file:9092"\n')
    cfg = load_config(cfg_file, environ={})
    assert cfg.model_name == "m"
    assert cfg.trainer.learning_rate == 1e-6 and cfg.trainer.groups_per_step == 2
    assert cfg.kafka.bootstrap_servers == "file:9092"
    assert cfg.sampler.top_p == 0.95  # untouched default
    env = {"ROLLWAY_TRAINER__GROUPS_PER_STEP": "8", "KAFKA_BOOTSTRAP_SERVERS": "env:1",
           "ROLLWAY_KAFKA__PARTITIONS": '{"tasks": 2}', "ROLLWAY_SAMPLER__TOP_P": "0.5"}
    cfg = load_config(cfg_file, environ=env)
    assert cfg.trainer.groups_per_step == 8
    assert cfg.trainer.learning_rate == 1e-6
    assert cfg.kafka.bootstrap_servers == "env:1"
    assert cfg.kafka.partitions == {"tasks": 2}
    assert cfg.sampler.top_p == 0.5


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="groups_per_step"):
        load_config(None, environ={"ROLLWAY_TRAINER__GROUPS_PER_STEP": "many"})
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nno_such_field = 1\n")
    with pytest.raises(ConfigError, match="no_such_field"):
        load_config(bad, environ={})
    broken = tmp_path / "broken.toml"
    broken.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken, environ={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", environ={})


def test_config_sources_merge_before_one_validation(tmp_path):
    """File, environment and a command's flags are merged as data and validated once:
    a flag is checked like a file value, and every error is one line naming the key."""
    toml = tmp_path / "r.toml"
    toml.write_text('[trainer]\ndevice = "cpu"\n[feeder]\ngroup_size = 3\n')
    cfg = load_config(toml, environ={"ROLLWAY_FEEDER__GROUP_SIZE": "5"}, overrides={"feeder": {"seed": 7}})
    assert (cfg.trainer.device, cfg.feeder.group_size, cfg.feeder.seed) == ("cpu", 5, 7)
    cfg = load_config(toml, environ={"ROLLWAY_FEEDER__GROUP_SIZE": "5"}, overrides={"feeder": {"group_size": 9}})
    assert cfg.feeder.group_size == 9  # the command line wins
    cases = [
        ({"ROLLWAY_TRAINER__STALE_POLICY": "drop"}, None,
         "trainer.stale_policy = 'drop'; expected one of drop_group, mask_tokens (config file"),
        ({}, {"sandbox": {"port": "http"}}, "sandbox.port: Expected `int`, got `str` (config file"),
        ({}, {"sandbox": {"cgroups": "on"}}, "sandbox.cgroups = 'on'; expected one of auto, off, required"),
        ({}, {"up": {"nope": 1}}, "unknown key up.nope"),
        ({}, {"feeder": {"groups_per_second": 0}}, "feeder.groups_per_second must be positive, got 0"),
    ]
    for environ, overrides, message in cases:
        with pytest.raises(ConfigError) as info:
            load_config(toml, environ=environ, overrides=overrides)
        assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_components_do_not_import_the_cli_package():
    """Components get their own sub-configs from the CLI; only a script's entry point
    (``if __name__ == "__main__":``) may reach for ``rollway``."""
    import ast

    def is_main_guard(node: ast.AST) -> bool:
        return isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)

    def imports(node: ast.AST):
        for child in ast.iter_child_nodes(node):
            if is_main_guard(child):
                continue
            if isinstance(child, ast.Import):
                yield from (a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                yield child.module
            yield from imports(child)

    found = [f"{path.relative_to(REPO)}: {name}"
             for package in ("bus", "sampler", "sandbox", "schemas", "syncer", "tasks", "trainer")
             for path in sorted((REPO / package).rglob("*.py"))
             for name in imports(ast.parse(path.read_text()))
             if name == "rollway" or name.startswith("rollway.")]
    assert found == []


def test_config_show_prints_effective_config():
    proc = run_cli("config", "show", "--format", "json", env={"ROLLWAY_TRAINER__SEED": "42"})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["trainer"]["seed"] == 42 and "kafka" in data and "sandbox" in data
    proc = run_cli("config", "show")
    assert proc.returncode == 0 and "[trainer]" in proc.stdout


def test_help_imports_nothing_heavy():
    code = (
        "import sys, rollway.cli as c\n"
        "c.build_parser()\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'aiokafka', 'numpy', 'aioboto3', 'aiohttp')"
        " if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
    proc = run_cli("--help")
    assert proc.returncode == 0 and "broker" in proc.stdout and "tail" in proc.stdout


def test_log_lines_are_json_with_role_and_replica():
    from rollway.logging import configure_logging

    import structlog

    stream = io.StringIO()
    configure_logging("sampler", replica_id="sampler-7", stream=stream)
    structlog.get_logger("x").info("rollout finished", tokens=12)
    import logging

    logging.getLogger("aiokafka").warning("library says hi")
    first, second = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert first["event"] == "rollout finished" and first["tokens"] == 12
    assert first["role"] == "sampler" and first["replica_id"] == "sampler-7" and first["level"] == "info"
    assert first["timestamp"].endswith("Z")
    assert second["event"] == "library says hi" and second["role"] == "sampler" and second["level"] == "warning"
    configure_logging("test", level="warning")


@pytest.mark.kafka
def test_broker_cli_start_status_stop(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    data = tmp_path / "k"
    proc = subprocess.run([sys.executable, "-m", "rollway.cli", "broker", "start", "--port", "0", "--data-dir", str(data)],
                          capture_output=True, text=True, env=env, timeout=180, cwd=REPO)
    try:
        assert proc.returncode == 0, proc.stderr
        assert "export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:" in proc.stdout
        state = json.loads((data / "cluster.json").read_text())
        assert len(state["nodes"]) == 1 and Path(state["nodes"][0]["log_file"]).exists()
        status = subprocess.run([sys.executable, "-m", "rollway.cli", "broker", "status", "--data-dir", str(data)],
                                capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
        assert status.returncode == 0 and "brokers answering: [1]" in status.stdout
        again = subprocess.run([sys.executable, "-m", "rollway.cli", "broker", "start", "--port", "0",
                                "--data-dir", str(data)], capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
        assert again.returncode == 1 and "already running" in again.stdout
    finally:
        stop = subprocess.run([sys.executable, "-m", "rollway.cli", "broker", "stop", "--data-dir", str(data)],
                              capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert stop.returncode == 0 and "stopped pids" in stop.stdout
    from rollway.broker import pid_alive

    assert not pid_alive(state["nodes"][0]["pid"])


def test_broker_cli_defers_to_external_cluster():
    proc = run_cli("broker", "start", env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    assert proc.returncode == 0 and "starting nothing" in proc.stdout


def test_ci_runs_the_suite_entry_point():
    # What the README says is prose; what matters is that CI runs the one entry point.
    ci = REPO / ".ci" / "run"
    assert os.access(ci, os.X_OK) and os.access(REPO / "scripts" / "test", os.X_OK)
    assert ci.read_text().rstrip().splitlines()[-1] == "exec scripts/test"


def test_compose_services_run_real_commands_with_a_valid_config():
    import yaml

    from rollway.cli import COMMANDS

    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    commands = {name for name, _, _ in COMMANDS}
    for name, service in compose["services"].items():
        if service.get("image", "").startswith("rollway") and "command" in service \
                and service.get("entrypoint") is None:
            assert service["command"][0] in commands, f"compose service {name} runs unknown command"
    env = compose["x-rollway"]["environment"]
    cfg = load_config(REPO / env["ROLLWAY_CONFIG"].removeprefix("/app/"), environ={})
    assert cfg.syncer.store_url.startswith("s3://") and cfg.syncer.s3_endpoint_url == "http://minio:9000"
    assert cfg.sampler.model_path == cfg.trainer.model_path == "/models/tiny"
    services = compose["services"]
    # The same main job as `rollway up`: every component, the learnable family, the warm
    # start built by init where the trainer and samplers load it.
    assert {"kafka", "minio", "init", "sandbox", "feeder", "sampler", "trainer", "evaluator"} <= set(services)
    assert cfg.feeder.tasks_dir == "family:train"
    assert f"rollway model init --out {cfg.trainer.model_path}" in services["init"]["command"][0]
    for name in ("sandbox", "feeder", "sampler", "trainer", "evaluator"):
        assert services[name]["depends_on"]["init"]["condition"] == "service_completed_successfully"
    # `--scale sampler=N` needs a sampler without a fixed name or host port.
    assert "container_name" not in services["sampler"] and "ports" not in services["sampler"]
    # The sandbox gets the capabilities its jail needs, named, never --privileged.
    sandbox = services["sandbox"]
    assert set(sandbox["cap_add"]) == {"SYS_ADMIN", "NET_ADMIN"} and not sandbox.get("privileged")
    # Its seccomp profile is Docker's default plus pivot_root (bwrap), not unconfined.
    seccomp = [opt.split("=", 1)[1] for opt in sandbox["security_opt"] if opt.startswith("seccomp=")]
    assert len(seccomp) == 1 and seccomp[0] != "unconfined"
    profile = json.loads((REPO / seccomp[0]).read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO"
    assert {"names": ["pivot_root"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}} \
        in profile["syscalls"]


def test_compose_smoke_override_swaps_only_third_party_images():
    import yaml

    class Loader(yaml.SafeLoader):  # compose's `!reset` tag (drop a merged value)
        pass

    Loader.add_constructor("!reset", lambda loader, node: None)
    override = yaml.load((REPO / "deploy/smoke/compose.override.yml").read_text(), Loader=Loader)
    assert set(override["services"]) == {"kafka", "minio"}
