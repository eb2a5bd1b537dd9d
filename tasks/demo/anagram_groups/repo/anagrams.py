def group_anagrams(words: list[str]) -> list[list[str]]:
    raise NotImplementedError
