from collections import defaultdict


def group_anagrams(words: list[str]) -> list[list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for word in words:
        groups["".join(sorted(word.lower()))].append(word)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])
