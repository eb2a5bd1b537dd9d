def _full(words: list[str], width: int) -> str:
    if len(words) == 1:
        return words[0].ljust(width)
    gaps = len(words) - 1
    spaces = width - sum(len(w) for w in words)
    base, extra = divmod(spaces, gaps)
    out = []
    for i, word in enumerate(words[:-1]):
        out.append(word + " " * (base + (1 if i < extra else 0)))
    out.append(words[-1])
    return "".join(out)


def justify(text: str, width: int) -> list[str]:
    if width < 1:
        raise ValueError("width must be at least 1")
    words = text.split()
    for w in words:
        if len(w) > width:
            raise ValueError(f"word {w!r} is longer than {width}")
    lines, current, length = [], [], 0
    for w in words:
        if current and length + 1 + len(w) > width:
            lines.append(_full(current, width))
            current, length = [], 0
        length += len(w) + (1 if current else 0)
        current.append(w)
    if current:
        lines.append(" ".join(current).ljust(width))
    return lines
