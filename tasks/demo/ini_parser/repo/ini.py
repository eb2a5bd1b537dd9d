class IniError(ValueError):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


def parse_ini(text: str) -> dict[str, dict[str, str]]:
    raise NotImplementedError
