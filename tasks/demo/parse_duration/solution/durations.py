import re

_PATTERN = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_SECONDS = (86400, 3600, 60, 1)


def parse_duration(text: str) -> int:
    stripped = text.strip()
    match = _PATTERN.fullmatch(stripped)
    if not stripped or match is None:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(g) * s for g, s in zip(match.groups(), _SECONDS) if g is not None)
