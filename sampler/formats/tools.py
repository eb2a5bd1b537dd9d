"""The agent's tools as a model sees them: OpenAI-style function definitions (JSON
schema), rendered into the prompt by the model's own chat template, and the check of a
parsed call against them (unknown tool, missing or mistyped argument: an error sentence
for the tool reply, never an exception)."""

from __future__ import annotations

from typing import Any


def _tool(name: str, description: str, properties: dict[str, dict[str, str]]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


TOOL_SCHEMAS: list[dict[str, Any]] = [
    _tool("run", "Run a shell command in the repository's workspace and return its output and exit code.",
          {"command": {"type": "string", "description": "The shell command (bash -c)."}}),
    _tool("read", "Read a file of the workspace.",
          {"path": {"type": "string", "description": "Path relative to the workspace."}}),
    _tool("write", "Create or overwrite a file of the workspace with the given content.",
          {"path": {"type": "string", "description": "Path relative to the workspace."},
           "content": {"type": "string", "description": "The whole new content of the file."}}),
    _tool("edit", "Replace one exact occurrence of a string in a file. old must occur exactly once; "
                  "include enough surrounding lines to make it unique.",
          {"path": {"type": "string", "description": "Path relative to the workspace."},
           "old": {"type": "string", "description": "The exact text to replace (must occur once)."},
           "new": {"type": "string", "description": "The replacement text."}}),
    _tool("submit", "Finish: the workspace is graded by the task's hidden tests. Call it when you are done.", {}),
]

TOOL_NAMES = tuple(t["function"]["name"] for t in TOOL_SCHEMAS)
_REQUIRED = {t["function"]["name"]: tuple(t["function"]["parameters"]["required"]) for t in TOOL_SCHEMAS}


def check_call(name: str, arguments: Any, tools: list[dict[str, Any]] | None = None) -> str | None:
    """Why a call cannot run (a sentence for the tool reply), or None when it can.
    ``tools``: the definitions offered (default: :data:`TOOL_SCHEMAS`)."""
    required = _REQUIRED if tools is None else {
        t["function"]["name"]: tuple(t["function"].get("parameters", {}).get("required", [])) for t in tools}
    if name not in required:
        return f"unknown tool {name[:40]!r}; the tools are {', '.join(required)}"
    if not isinstance(arguments, dict):
        return f"{name}: arguments must be a JSON object, got {type(arguments).__name__}"
    missing = [a for a in required[name] if a not in arguments]
    if missing:
        return f"{name}: missing argument{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
    bad = [a for a in required[name] if not isinstance(arguments[a], str)]
    if bad:
        return f"{name}: argument{'s' if len(bad) > 1 else ''} {', '.join(bad)} must be a string"
    return None


def apply_edit(text: str, old: str, new: str, path: str) -> str:
    """``text`` with the one occurrence of ``old`` replaced by ``new``; ValueError with a
    clear message when ``old`` is empty, absent or not unique."""
    if not old:
        raise ValueError(f"edit {path}: old is empty; give the exact text to replace")
    count = text.count(old)
    if count == 0:
        raise ValueError(f"edit {path}: old text not found (it must match the file exactly, whitespace included)")
    if count > 1:
        raise ValueError(f"edit {path}: old text occurs {count} times; include more surrounding lines to make it unique")
    return text.replace(old, new, 1)
