"""The sandbox API's bearer tokens (#32, sandbox/auth.py) over real HTTP: 401 without a
known token (logged, the token never), 403 for a role's forbidden call, a session only
for the token that created it. No command runs: these are the API's doors."""

from __future__ import annotations

import aiohttp
import pytest
import structlog

from bus.security import generate_credentials, write_credentials
from sandbox.client import SandboxClient, SandboxError
from sandbox.config import SandboxConfig
from tasks.spec import TaskSpec
from tasks.store import TaskStore
from tests.sandbox_helpers import live_sandbox

FILES = {"main.py": "print('hi')\n"}


@pytest.fixture
def tokens(tmp_path):
    creds = generate_credentials()
    write_credentials(tmp_path / "credentials.json", creds)
    return tmp_path / "credentials.json", creds.sandbox


async def test_sandbox_api_tokens_roles_and_session_owners(tmp_path, tokens):
    path, token = tokens
    (tmp_path / "tasks").mkdir()
    cfg = SandboxConfig(workspace_root=str(tmp_path / "ws"), tasks_dir=str(tmp_path / "tasks"), tokens_file=str(path),
                        max_sessions=4)
    async with live_sandbox(cfg, store=TaskStore(cfg.tasks_dir)) as live:
        # No token, an unknown one: 401, logged without the token.
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer not-a-token-123"}, {"Authorization": token["sampler"]}):
                with structlog.testing.capture_logs() as logs:
                    async with http.post(f"{live.url}/sessions", json={"task_id": "t", "files": FILES},
                                         headers=headers) as resp:
                        assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
                assert [e["event"] for e in logs] == ["sandbox_unauthenticated"]
                assert "not-a-token-123" not in repr(logs) and token["sampler"] not in repr(logs)
            async with http.get(f"{live.url}/health") as resp:
                assert resp.status == 401

        async with SandboxClient(live.url, token=token["sampler"]) as sampler, \
                SandboxClient(live.url, token=token["evaluator"]) as evaluator, \
                SandboxClient(live.url, token=token["admin"]) as admin:
            assert (await sampler.health())["capacity"] == 4
            sid = await sampler.create_session("t", files=FILES)
            assert await sampler.write_file(sid, "b.py", "x = 1\n") == 6
            assert await sampler.read_file(sid, "main.py") == FILES["main.py"]
            # Another token may not touch it (as if it did not exist); the admin may.
            for call in (evaluator.read_file(sid, "main.py"), evaluator.write_file(sid, "c.py", ""),
                         evaluator.exec(sid, "true")):
                with pytest.raises(SandboxError) as refused:
                    await call
                assert refused.value.status == 404
            assert await admin.read_file(sid, "b.py") == "x = 1\n"
            # Grader-side endpoints: a sampler registers no task (its tests would pay it)...
            spec = TaskSpec(task_id="mine", instruction="x", files=FILES,
                            hidden_tests={"test_x.py": "def test_x():\n    pass\n"})
            with pytest.raises(SandboxError) as refused:
                await sampler.register_task(spec)
            assert refused.value.status == 403
            assert await evaluator.register_task(spec) is True
            # ...and the evaluator grades without publishing only.
            esid = await evaluator.create_session("mine")
            with pytest.raises(SandboxError) as refused:
                await evaluator.submit(esid, trajectory_id="e-1")
            assert refused.value.status == 403 and "publish" in refused.value.message
            await sampler.close_session(sid)
            with pytest.raises(SandboxError) as gone:
                await sampler.read_file(sid, "main.py")
            assert gone.value.status == 404
