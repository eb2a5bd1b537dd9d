"""The asyncio client of the sandbox service's HTTP API (docs/contracts.md, "Sandbox service").

One client serves the sampler's rollouts and the tests: typed answers (``ExecResult``,
``Reward``), 429 (no free session or command slot) retried with backoff, a submit whose
reward publish failed (502) retried, closing an already closed session is not an error.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
import structlog

from schemas import Cost, Reward

if TYPE_CHECKING:
    from tasks.spec import TaskSpec

log = structlog.get_logger(__name__)


class SandboxError(RuntimeError):
    """The service answered with an error: ``status``, its ``{"error": ...}`` text, the
    request ``path`` and the whole answer ``body`` (a 502 on submit has ``"reward"``)."""

    def __init__(self, status: int, message: str, path: str = "", body: dict[str, Any] | None = None) -> None:
        super().__init__(f"sandbox {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.path = path
        self.body = body or {}


class SandboxBusy(SandboxError):
    """429 after every retry: no session or command slot came free."""


class ExecResult(msgspec.Struct, kw_only=True):
    """The answer of ``exec`` (fields as in docs/contracts.md)."""

    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    killed: str = ""
    limits: list[str] = msgspec.field(default_factory=list)


class SandboxClient:
    """One aiohttp session to one sandbox service; share it across rollouts.

    ``async with SandboxClient(url) as sb: sid = await sb.create_session(task_id)``.
    ``busy_retries``: how often a 429 is retried (backoff 0.2 s doubling to 2 s) before
    ``SandboxBusy``; ``submit_retries``: how often a 502 submit is retried.
    ``publish_rewards=False`` (evaluation): submits grade without publishing the reward.
    ``token``: the API's bearer token (sandbox/auth.py); None: this process's role's.
    """

    def __init__(
        self, base_url: str, *, timeout_s: float = 300.0, busy_retries: int = 20, submit_retries: int = 2,
        publish_rewards: bool = True, token: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if token is None:  # this process's role's token (bus.security), "" for an open sandbox
            from bus.security import process_sandbox_token

            token = process_sandbox_token()
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.publish_rewards = publish_rewards
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.busy_retries = busy_retries
        self.submit_retries = submit_retries
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "SandboxClient":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=self.timeout, headers=self._headers)

    async def close(self) -> None:
        """Close the HTTP session (not a sandbox session: that is ``close_session``)."""
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One raw call (``kwargs`` go to aiohttp: ``json``, ``params``, ``data``); the
        decoded JSON answer, or ``SandboxError``. 429 is retried ``busy_retries`` times."""
        await self.start()
        delay = 0.2
        for attempt in range(self.busy_retries + 1):
            async with self._http.request(method, self.base_url + path, **kwargs) as resp:
                try:
                    body = await resp.json(content_type=None)
                except (aiohttp.ContentTypeError, ValueError):
                    body = {"error": (await resp.text())[:500]}
                if resp.status < 400:
                    return body
                if not isinstance(body, dict):
                    body = {"error": str(body)}
                message = str(body.get("error", body))
                if resp.status == 429 and attempt < self.busy_retries:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                cls = SandboxBusy if resp.status == 429 else SandboxError
                raise cls(resp.status, message, path, body)
        raise AssertionError("unreachable")

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/health")

    async def create_session(self, task_id: str, files: dict[str, str] | None = None) -> str:
        """A new session; ``files`` omitted: the task's repo from the service's task store."""
        payload: dict[str, Any] = {"task_id": task_id}
        if files is not None:
            payload["files"] = files
        return (await self.request("POST", "/sessions", json=payload))["session_id"]

    async def exec(self, session_id: str, command: str, timeout_s: float | None = None) -> ExecResult:
        payload: dict[str, Any] = {"command": command}
        if timeout_s is not None:
            payload["timeout_s"] = timeout_s
        body = await self.request("POST", f"/sessions/{session_id}/exec", json=payload)
        return msgspec.convert(body, ExecResult, strict=False)

    async def read_file(self, session_id: str, path: str) -> str:
        body = await self.request("GET", f"/sessions/{session_id}/files", params={"path": path})
        return body["content"]

    async def write_file(self, session_id: str, path: str, content: str) -> int:
        """Bytes written."""
        body = await self.request("PUT", f"/sessions/{session_id}/files", json={"path": path, "content": content})
        return int(body["bytes"])

    async def submit(
        self,
        session_id: str,
        *,
        trajectory_id: str,
        task_id: str = "",
        group_id: str = "",
        sample_index: int = 0,
        attempt: str = "",
        cost: Cost | None = None,
        weight_version: int = -1,
        trainer_step: int = -1,
    ) -> Reward:
        """Grade the session (and close it); the ``Reward`` the service published.
        ``trainer_step`` picks the reward phase when ``reward.phase_unit = "step"``."""
        payload = {
            "trajectory_id": trajectory_id,
            "task_id": task_id,
            "group_id": group_id,
            "sample_index": sample_index,
            "attempt": attempt,
            "cost": msgspec.to_builtins(cost or Cost()),
            "weight_version": weight_version,
            "trainer_step": trainer_step,
        }
        for retry in range(self.submit_retries + 1):
            try:
                body = await self.request("POST", f"/sessions/{session_id}/submit", json=payload,
                                          params=None if self.publish_rewards else {"publish": "false"})
                break
            except SandboxError as exc:
                # 502: graded, but publishing the reward failed; the service keeps the
                # verdict and publishes it again on a retried submit.
                if exc.status != 502 or retry == self.submit_retries:
                    raise
                log.warning("submit: reward publish failed; retrying", session_id=session_id, error=exc.message)
                await asyncio.sleep(1.0 + retry)
        return msgspec.convert(body, Reward, strict=False)

    async def register_task(self, spec: "TaskSpec") -> bool:
        """Make ``spec`` (hidden tests included) gradable by the service; True when it was
        new there. A different task under a known id is refused (409)."""
        body = await self.request("POST", "/tasks", json=msgspec.to_builtins(spec))
        return bool(body["added"])

    async def close_session(self, session_id: str) -> None:
        """Close a session; one already gone (404) counts as closed."""
        try:
            await self.request("DELETE", f"/sessions/{session_id}")
        except SandboxError as exc:
            if exc.status != 404:
                raise
