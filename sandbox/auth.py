"""Bearer tokens for the sandbox API (docs/security.md).

Every request carries ``Authorization: Bearer <token>``; the token names a role:

* ``sampler``: sessions (create, exec, files, close) and submit (the reward is published);
* ``evaluator``: the same, but submits only with ``?publish=false`` (evaluation never
  writes rewards), and registers held-out tasks (``POST /tasks``);
* ``admin``: everything, on every session.

No token or an unknown one: 401 (logged with the path and the peer, never the token).
A role calling what it may not: 403. A session belongs to the token that created it:
another token gets 404, as for a session that does not exist. Tokens come from
``sandbox.tokens_file`` (the ``sandbox`` section of the credentials file that ``rollway
broker start`` / ``rollway up`` write, mode 0600); without one the API is open and the
service says so once at start.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
from typing import Awaitable, Callable

import msgspec
import structlog
from aiohttp import web

log = structlog.get_logger(__name__)

SESSION_ROLES = frozenset({"sampler", "evaluator", "admin"})
# Bound on remembered session owners; a forgotten session is refused (404), never opened.
MAX_OWNERS = 65_536

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="rollway-sandbox"'} if status == 401 else None
    return web.Response(body=msgspec.json.encode({"error": message}), status=status,
                        content_type="application/json", headers=headers)


def allowed_roles(request: web.Request) -> frozenset[str]:
    """The roles that may make this request."""
    path = request.path
    if path == "/health":
        return SESSION_ROLES
    if path == "/tasks":
        return frozenset({"admin", "evaluator"})
    if path.endswith("/submit") and request.query.get("publish", "true").lower() != "false":
        return frozenset({"admin", "sampler"})
    return SESSION_ROLES


class SandboxAuth:
    """The aiohttp middleware (``auth.middleware``) over ``tokens`` (role -> token)."""

    def __init__(self, tokens: dict[str, str]) -> None:
        unknown = set(tokens) - SESSION_ROLES
        if unknown:
            raise ValueError(f"sandbox tokens for unknown roles {sorted(unknown)}; roles: {sorted(SESSION_ROLES)}")
        self._tokens = [(role, token.encode()) for role, token in tokens.items() if token]
        self._owners: collections.OrderedDict[str, str] = collections.OrderedDict()

    def role_of(self, token: str) -> str | None:
        given = token.encode()
        found = None
        for role, known in self._tokens:  # every one compared, in constant time
            if hmac.compare_digest(given, known):
                found = role
        return found

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization", "")
        token = header[len("Bearer "):].strip() if header.startswith("Bearer ") else ""
        role = self.role_of(token) if token else None
        if role is None:
            log.warning("sandbox_unauthenticated", method=request.method, path=request.path, peer=request.remote,
                        reason="unknown token" if token else "no bearer token")
            return _error(401, "authentication required: send Authorization: Bearer <token>")
        if role not in allowed_roles(request):
            log.warning("sandbox_forbidden", role=role, method=request.method, path=request.path, peer=request.remote)
            return _error(403, f"the {role} token may not {request.method} {request.path}"
                               + ("?publish=true" if request.path.endswith("/submit") else ""))
        owner = hashlib.sha256(token.encode()).hexdigest()
        session_id = request.match_info.get("id")
        if session_id is not None and role != "admin" and self._owners.get(session_id) != owner:
            log.warning("sandbox_session_refused", role=role, session_id=session_id, peer=request.remote)
            return _error(404, f"no session {session_id}")
        response = await handler(request)
        if response.status < 300:
            if request.method == "POST" and request.path == "/sessions":
                self._remember(response, owner)
            elif session_id is not None and (request.method == "DELETE" or request.path.endswith("/submit")):
                self._owners.pop(session_id, None)
        return response

    def _remember(self, response: web.StreamResponse, owner: str) -> None:
        body = getattr(response, "body", None)
        try:
            session_id = msgspec.json.decode(body)["session_id"]
        except (TypeError, KeyError, msgspec.DecodeError):
            return
        self._owners[session_id] = owner
        while len(self._owners) > MAX_OWNERS:
            self._owners.popitem(last=False)


def load_tokens(path: str) -> dict[str, str]:
    """The ``sandbox`` section of a credentials file (bus.security; owner-only mode checked)."""
    from bus.security import load_credentials

    return dict(load_credentials(path).sandbox)


def bearer_auth(cfg) -> list[Callable]:
    """The service's auth middleware for ``cfg`` (a SandboxConfig): [] (an open API,
    logged once) without ``tokens_file``."""
    if not cfg.tokens_file:
        log.warning("sandbox_api_open", hint="no sandbox.tokens_file: any client that reaches the port may "
                                             "create sessions and register tasks")
        return []
    return [SandboxAuth(load_tokens(cfg.tokens_file)).middleware]
