def fullmatch(pattern: str, text: str) -> bool:
    raise NotImplementedError
