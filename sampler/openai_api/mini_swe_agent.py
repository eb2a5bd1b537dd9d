"""mini-swe-agent (PyPI ``mini-swe-agent``) as the harness of a Rollway episode.

mini-swe-agent runs its own loop: its ``LitellmModel`` asks an OpenAI-compatible
endpoint for each turn (here: the episode's base URL on a sampler replica, model
``openai/<served name>``), and its environment runs each ``bash`` tool call. This module
gives it the environment that runs commands in the **episode's sandbox session**
(:class:`RollwaySandboxEnvironment`, through ``POST /v1/rollway/episodes/{id}/exec``), so
the workspace the sandbox grades is the one the agent edited, and a driver
(:func:`run_episode`) that creates the episode, runs the agent with the package's own
``mini.yaml`` configuration and grades the episode when the agent stops.

The agent's end (``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``, mini-swe-agent's submit
convention) submits the episode; an agent that stops otherwise (step limit, repeated
format errors) is submitted by the driver with its exit status as the finish reason.

Offline: litellm would fetch its model cost map from GitHub at import;
``LITELLM_LOCAL_MODEL_COST_MAP=True`` makes it use its bundled copy, and cost tracking
is off (``cost_tracking: ignore_errors``: a local model has no price).
"""

from __future__ import annotations

import os
import platform
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
# mini-swe-agent retries a failed model call 10 times, waiting 4-60 s between tries; the
# endpoint's refusals (4xx) are final, so one try (raise it for a flaky network).
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")

import requests  # noqa: E402  (a dependency of mini-swe-agent)
from pydantic import BaseModel  # noqa: E402

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class RollwaySandboxEnvironmentConfig(BaseModel):
    endpoint: str
    """The sampler replica's endpoint root, e.g. ``http://127.0.0.1:8400``."""
    episode_id: str
    timeout: int = 30
    """Seconds per command (the sampler caps it further at ``sampler.max_tool_seconds``)."""
    request_timeout_s: float = 300.0


class RollwaySandboxEnvironment:
    """A mini-swe-agent ``Environment`` whose commands run in a Rollway episode's sandbox
    session. Usable from mini-swe-agent's own configs as
    ``environment_class: sampler.openai_api.mini_swe_agent.RollwaySandboxEnvironment``."""

    def __init__(self, *, config_class: type = RollwaySandboxEnvironmentConfig, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)
        self.base = f"{self.config.endpoint.rstrip('/')}/v1/rollway/episodes/{self.config.episode_id}"
        self.http = requests.Session()
        self.submission: dict[str, Any] | None = None  # the episode after its grading

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        resp = self.http.post(self.base + path, json=payload, timeout=self.config.request_timeout_s)
        body = resp.json()
        if resp.status_code >= 400:
            raise RuntimeError(f"rollway {path}: HTTP {resp.status_code}: {body.get('error', {}).get('message', body)}")
        return body

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        if cwd:
            command = f"cd {cwd} && {command}"
        try:
            res = self._post("/exec", {"command": command, "timeout_s": timeout or self.config.timeout})
        except Exception as exc:  # noqa: BLE001 - mini-swe-agent shows errors to the model
            return {"output": "", "returncode": -1, "exception_info": f"An error occurred while executing the "
                    f"command: {exc}", "extra": {"exception_type": type(exc).__name__, "exception": str(exc)}}
        output = res.get("stdout", "") + res.get("stderr", "")
        notes = []
        if res.get("timed_out"):
            notes.append(f"the command timed out after {timeout or self.config.timeout}s")
        if res.get("killed"):
            notes.append(f"killed: {res['killed']}")
        code = res.get("exit_code")
        out = {"output": output, "returncode": -1 if code is None else code, "exception_info": "; ".join(notes)}
        self._check_finished(out)
        return out

    def submit(self, finish_reason: str = "submitted") -> dict[str, Any]:
        """Grade the episode (idempotent); the episode with its ``reward``."""
        if self.submission is None:
            self.submission = self._post("/submit", {"finish_reason": finish_reason})
        return self.submission

    def _check_finished(self, output: dict[str, Any]) -> None:
        """mini-swe-agent's submit convention: the marker alone on the first output line."""
        from minisweagent.exceptions import Submitted

        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            episode = self.submit("submitted")
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission,
                                       "reward": episode.get("reward")}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # The sandbox runs on this host's kernel: uname is the same inside.
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {
            "environment": self.config.model_dump(mode="json"),
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"}}}


def mini_config() -> dict[str, Any]:
    """mini-swe-agent's own tool-calling configuration (``config/mini.yaml`` of the package)."""
    import yaml
    from minisweagent import package_dir

    return yaml.safe_load((package_dir / "config" / "mini.yaml").read_text())


def create_episode(endpoint: str, spec: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    resp = requests.post(f"{endpoint.rstrip('/')}/v1/rollway/episodes", json=spec, timeout=timeout_s)
    body = resp.json()
    if resp.status_code >= 400:
        raise RuntimeError(f"rollway: creating the episode failed: HTTP {resp.status_code}: {body}")
    return body


# The environment mini-swe-agent's ``mini`` CLI needs to run unattended and offline.
CLI_ENV = {
    "MSWEA_CONFIGURED": "true",  # else the CLI's first run asks for a default model on the terminal
    "MSWEA_SILENT_STARTUP": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
}


def cli_config(endpoint: str, episode: dict[str, Any], *, model: str | None = None,
               agent: dict[str, Any] | None = None, model_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config for mini-swe-agent's ``mini`` CLI, merged over its own ``mini.yaml`` (``mini
    -c mini.yaml -c THIS.yaml -y --exit-immediately -t TASK``, with :data:`CLI_ENV` and
    this repository on ``PYTHONPATH``): the episode's base URL as the model's API base,
    commands in the episode's sandbox session. ``episode``: ``POST /v1/rollway/episodes``'s
    answer. The CLI grades the episode only through the submit convention; a run that
    stops otherwise (step limit) leaves it open: ``POST .../submit`` it afterwards."""
    return {
        "agent": {**(agent or {})},
        "model": {"model_class": "litellm", "model_name": f"openai/{model or episode['model']}",
                  "cost_tracking": "ignore_errors",
                  "model_kwargs": {"api_base": episode["base_url"], "api_key": "rollway", "num_retries": 0,
                                   **(model_kwargs or {})}},
        "environment": {"environment_class": f"{RollwaySandboxEnvironment.__module__}.RollwaySandboxEnvironment",
                        "endpoint": endpoint, "episode_id": episode["id"]},
    }


def run_episode(endpoint: str, spec: dict[str, Any], *, model: str | None = None, step_limit: int = 10,
                model_kwargs: dict[str, Any] | None = None, agent_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Create an episode for ``spec`` (``POST /v1/rollway/episodes``'s body), run
    mini-swe-agent on it until it submits or stops, grade it. Returns the agent's exit
    status, its messages and the graded episode (``["episode"]["reward"]``).

    Blocking (mini-swe-agent is synchronous): run it in a thread from async code."""
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_model import LitellmModel

    episode = create_episode(endpoint, spec)
    config = mini_config()
    llm = LitellmModel(
        **{**config.get("model", {}),
           "model_name": f"openai/{model or episode['model']}",
           "model_kwargs": {**config.get("model", {}).get("model_kwargs", {}), "api_base": episode["base_url"],
                            "api_key": "rollway", "num_retries": 0, **(model_kwargs or {})},
           "cost_tracking": "ignore_errors"})
    env = RollwaySandboxEnvironment(endpoint=endpoint, episode_id=episode["id"])
    agent_config = {k: v for k, v in config["agent"].items() if k != "mode"}  # mode: the interactive agent's
    agent = DefaultAgent(llm, env, **{**agent_config, "step_limit": step_limit, **(agent_overrides or {})})
    try:
        result = agent.run(spec.get("instruction") or episode.get("instruction", ""))
    finally:
        if env.submission is None:
            status = (agent.messages[-1].get("extra", {}).get("exit_status") if agent.messages else "") or "stopped"
            env.submit(f"agent_{status}"[:64])
    return {"exit_status": result.get("exit_status", ""), "messages": agent.messages, "episode": env.submission,
            "n_calls": agent.n_calls}
