def encrypt(text: str, shift: int) -> str:
    raise NotImplementedError


def decrypt(text: str, shift: int) -> str:
    raise NotImplementedError
