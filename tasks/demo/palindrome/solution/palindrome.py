def is_palindrome(text: str) -> bool:
    chars = [ch.lower() for ch in text if ch.isalnum()]
    return chars == chars[::-1]
