def parse_duration(text: str) -> int:
    raise NotImplementedError
