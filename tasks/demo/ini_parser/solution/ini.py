class IniError(ValueError):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


def parse_ini(text: str) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("[") and line.endswith("]"):
            name = line[1:-1].strip()
            if not name:
                raise IniError(number, "empty section name")
            current = sections.setdefault(name, {})
            continue
        if "=" not in line:
            raise IniError(number, f"expected 'key = value' or '[section]', got {raw!r}")
        if current is None:
            raise IniError(number, "key outside of any section")
        key, value = line.split("=", 1)
        key = key.strip().lower()
        if not key:
            raise IniError(number, "empty key")
        current[key] = value.strip()
    return sections
