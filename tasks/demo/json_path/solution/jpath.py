import re

MISSING = object()

_STEP = re.compile(r"(?:^|\.)([A-Za-z0-9_-]+)|\[(-?\d+)\]")


def _parse(path: str) -> list:
    steps, pos = [], 0
    while pos < len(path):
        match = _STEP.match(path, pos)
        if match is None or (match.group(0).startswith(".") and pos == 0):
            raise ValueError(f"invalid path {path!r} at position {pos}")
        key, index = match.groups()
        steps.append(key if key is not None else int(index))
        pos = match.end()
    if not steps:
        raise ValueError("empty path")
    return steps


def get_path(data, path: str, default=MISSING):
    node = data
    for step in _parse(path):
        try:
            if isinstance(step, str):
                if not isinstance(node, dict):
                    raise KeyError(step)
                node = node[step]
            else:
                if not isinstance(node, list):
                    raise KeyError(step)
                node = node[step]
        except (KeyError, IndexError):
            if default is not MISSING:
                return default
            raise KeyError(f"{path!r}: no {step!r}") from None
    return node
