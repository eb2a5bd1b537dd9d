import re
from itertools import groupby


def encode(text: str) -> str:
    return "".join(f"{len(list(run))}{ch}" for ch, run in groupby(text))


_TOKEN = re.compile(r"(\d+)(\D)", re.DOTALL)


def decode(encoded: str) -> str:
    out = []
    pos = 0
    while pos < len(encoded):
        match = _TOKEN.match(encoded, pos)
        if match is None:
            raise ValueError(f"malformed run-length text at position {pos}: {encoded[pos:pos + 10]!r}")
        count = int(match.group(1))
        if count == 0:
            raise ValueError(f"zero count at position {pos}")
        out.append(match.group(2) * count)
        pos = match.end()
    return "".join(out)
