def edit_distance(a: str, b: str) -> int:
    raise NotImplementedError


def suggest(word: str, vocabulary: list[str], max_distance: int = 2, limit: int = 3) -> list[str]:
    raise NotImplementedError
