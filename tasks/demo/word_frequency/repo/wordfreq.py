def top_words(text: str, n: int) -> list[tuple[str, int]]:
    raise NotImplementedError
