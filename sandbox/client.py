"""A small asyncio client of the sandbox service's HTTP API (docs/contracts.md)."""

from __future__ import annotations

from typing import Any

import aiohttp

from schemas import Cost


class SandboxError(RuntimeError):
    """The service answered with an error status; ``status`` and the message it gave."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"sandbox service {status}: {message}")
        self.status = status
        self.message = message
        self.body = body or {}


class SandboxClient:
    """``async with SandboxClient("http://127.0.0.1:8300") as sb: sid = await sb.create(...)``."""

    def __init__(self, base_url: str, *, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "SandboxClient":
        self._http = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()

    async def request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        assert self._http is not None, "use SandboxClient as an async context manager"
        async with self._http.request(method, self.base_url + path, **kwargs) as resp:
            try:
                body = await resp.json(content_type=None)
            except ValueError:
                body = {"error": (await resp.text())[:500]}
            if resp.status >= 400:
                raise SandboxError(resp.status, str(body.get("error", body)), body)
            return body

    async def create(self, task_id: str, files: dict[str, str] | None = None) -> str:
        payload: dict[str, Any] = {"task_id": task_id}
        if files is not None:
            payload["files"] = files
        return (await self.request("POST", "/sessions", json=payload))["session_id"]

    async def exec(self, session_id: str, command: str, timeout_s: float | None = None) -> dict[str, Any]:
        payload: dict[str, Any] = {"command": command}
        if timeout_s is not None:
            payload["timeout_s"] = timeout_s
        return await self.request("POST", f"/sessions/{session_id}/exec", json=payload)

    async def read(self, session_id: str, path: str) -> str:
        return (await self.request("GET", f"/sessions/{session_id}/files", params={"path": path}))["content"]

    async def write(self, session_id: str, path: str, content: str) -> int:
        body = await self.request("PUT", f"/sessions/{session_id}/files", json={"path": path, "content": content})
        return body["bytes"]

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
    ) -> dict[str, Any]:
        c = cost or Cost()
        payload = {
            "trajectory_id": trajectory_id, "task_id": task_id, "group_id": group_id,
            "sample_index": sample_index, "attempt": attempt, "weight_version": weight_version,
            "trainer_step": trainer_step,
            "cost": {"generated_tokens": c.generated_tokens, "env_tokens": c.env_tokens, "turns": c.turns,
                     "tool_seconds": c.tool_seconds, "segments": c.segments},
        }
        return await self.request("POST", f"/sessions/{session_id}/submit", json=payload)

    async def close(self, session_id: str) -> None:
        await self.request("DELETE", f"/sessions/{session_id}")

    async def health(self) -> dict[str, Any]:
        return await self.request("GET", "/health")
