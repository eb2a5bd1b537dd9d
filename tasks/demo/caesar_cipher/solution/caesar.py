import string


def _shift_char(ch: str, shift: int) -> str:
    for alphabet in (string.ascii_lowercase, string.ascii_uppercase):
        if ch in alphabet:
            return alphabet[(alphabet.index(ch) + shift) % 26]
    return ch


def encrypt(text: str, shift: int) -> str:
    return "".join(_shift_char(ch, shift) for ch in text)


def decrypt(text: str, shift: int) -> str:
    return encrypt(text, -shift)
