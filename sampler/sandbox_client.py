"""HTTP client of the sandbox service (contract: docs/contracts.md, "Sandbox service")."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import structlog

from schemas import Cost, Reward

log = structlog.get_logger(__name__)


class SandboxError(RuntimeError):
    """The sandbox answered with an error (``status`` and its ``{"error": ...}`` text)."""

    def __init__(self, status: int, message: str, path: str) -> None:
        super().__init__(f"sandbox {path}: HTTP {status}: {message}")
        self.status = status
        self.message = message


class SandboxBusy(SandboxError):
    """429: the session pool is full; retry later."""


class ExecResult(msgspec.Struct, kw_only=True):
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    timed_out: bool = False
    duration_s: float = 0.0
    killed: str = ""


class SandboxClient:
    """One aiohttp session to one sandbox service; share it across rollouts."""

    def __init__(self, base_url: str, *, timeout_s: float = 60.0, busy_retries: int = 20) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.busy_retries = busy_retries
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "SandboxClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=self.timeout)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _request(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        await self.start()
        delay = 0.2
        for attempt in range(self.busy_retries + 1):
            async with self._http.request(method, self.base_url + path, json=json, params=params) as resp:
                try:
                    body = await resp.json(content_type=None)
                except (aiohttp.ContentTypeError, ValueError):
                    body = {"error": (await resp.text())[:500]}
                if resp.status < 400:
                    return body
                message = body.get("error", str(body)) if isinstance(body, dict) else str(body)
                if resp.status == 429 and attempt < self.busy_retries:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                cls = SandboxBusy if resp.status == 429 else SandboxError
                raise cls(resp.status, message, path)
        raise AssertionError("unreachable")

    async def health(self) -> dict:
        return await self._request("GET", "/health")

    async def create_session(self, task_id: str, files: dict[str, str]) -> str:
        body = await self._request("POST", "/sessions", json={"task_id": task_id, "files": files})
        return body["session_id"]

    async def exec(self, session_id: str, command: str, timeout_s: float | None = None) -> ExecResult:
        payload: dict[str, Any] = {"command": command}
        if timeout_s is not None:
            payload["timeout_s"] = timeout_s
        body = await self._request("POST", f"/sessions/{session_id}/exec", json=payload)
        return msgspec.convert(body, ExecResult, strict=False)

    async def read_file(self, session_id: str, path: str) -> str:
        body = await self._request("GET", f"/sessions/{session_id}/files", params={"path": path})
        return body["content"]

    async def write_file(self, session_id: str, path: str, content: str) -> int:
        body = await self._request("PUT", f"/sessions/{session_id}/files", json={"path": path, "content": content})
        return int(body.get("bytes", len(content.encode())))

    async def submit(
        self,
        session_id: str,
        *,
        trajectory_id: str,
        task_id: str,
        group_id: str,
        sample_index: int,
        attempt: str,
        cost: Cost,
        weight_version: int,
    ) -> Reward:
        payload = {
            "trajectory_id": trajectory_id,
            "task_id": task_id,
            "group_id": group_id,
            "sample_index": sample_index,
            "attempt": attempt,
            "cost": msgspec.to_builtins(cost),
            "weight_version": weight_version,
        }
        for attempt in range(3):
            try:
                body = await self._request("POST", f"/sessions/{session_id}/submit", json=payload)
                break
            except SandboxError as exc:
                # 502: graded, but publishing the reward failed; the service keeps the
                # verdict and publishes it again on a retried submit.
                if exc.status != 502 or attempt == 2:
                    raise
                log.warning("submit: reward publish failed; retrying", session_id=session_id, error=exc.message)
                await asyncio.sleep(1.0 + attempt)
        return msgspec.convert(body, Reward, strict=False)

    async def close_session(self, session_id: str) -> None:
        try:
            await self._request("DELETE", f"/sessions/{session_id}")
        except SandboxError as exc:
            if exc.status != 404:
                raise
