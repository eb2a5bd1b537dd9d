def reverse_words(sentence: str) -> str:
    return " ".join(reversed(sentence.split()))
