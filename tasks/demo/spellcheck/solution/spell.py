def edit_distance(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def suggest(word: str, vocabulary: list[str], max_distance: int = 2, limit: int = 3) -> list[str]:
    scored = []
    for candidate in set(vocabulary):
        d = edit_distance(word.lower(), candidate.lower())
        if d <= max_distance:
            scored.append((d, candidate))
    return [c for _, c in sorted(scored)[:limit]]
