def count_vowels(text: str) -> int:
    raise NotImplementedError
