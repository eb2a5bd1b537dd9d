def reverse_words(sentence: str) -> str:
    raise NotImplementedError
