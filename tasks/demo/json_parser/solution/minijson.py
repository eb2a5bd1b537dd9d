class JSONError(ValueError):
    def __init__(self, message: str, pos: int) -> None:
        super().__init__(f"{message} at position {pos}")
        self.pos = pos


_WS = " \t\n\r"
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"true": True, "false": False, "null": None}


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in _WS:
            self.i += 1

    def expect(self, ch: str) -> None:
        if self.i >= len(self.s) or self.s[self.i] != ch:
            raise JSONError(f"expected {ch!r}", self.i)
        self.i += 1

    def value(self):
        self.ws()
        if self.i >= len(self.s):
            raise JSONError("unexpected end of input", self.i)
        ch = self.s[self.i]
        if ch == "{":
            return self.obj()
        if ch == "[":
            return self.arr()
        if ch == '"':
            return self.string()
        for word, val in _LITERALS.items():
            if ch == word[0]:
                return self.literal(word, val)
        if ch == "-" or ch.isdigit():
            return self.number()
        raise JSONError(f"unexpected character {ch!r}", self.i)

    def literal(self, word: str, val):
        for k, expected in enumerate(word):
            if self.i + k >= len(self.s) or self.s[self.i + k] != expected:
                raise JSONError(f"invalid literal, expected {word!r}", self.i + k)
        self.i += len(word)
        return val

    def digits(self) -> None:
        """One or more ASCII digits, else an error where the first one should be."""
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in "0123456789":
            self.i += 1
        if self.i == start:
            raise JSONError("expected a digit", self.i)

    def number(self):
        start = self.i
        if self.s[self.i] == "-":
            self.i += 1
        if self.i < len(self.s) and self.s[self.i] == "0":
            self.i += 1
        else:
            self.digits()
        is_float = False
        if self.i < len(self.s) and self.s[self.i] == ".":
            self.i += 1
            self.digits()
            is_float = True
        if self.i < len(self.s) and self.s[self.i] in "eE":
            self.i += 1
            if self.i < len(self.s) and self.s[self.i] in "+-":
                self.i += 1
            self.digits()
            is_float = True
        text = self.s[start:self.i]
        return float(text) if is_float else int(text)

    def obj(self) -> dict:
        self.i += 1
        out = {}
        self.ws()
        if self.i < len(self.s) and self.s[self.i] == "}":
            self.i += 1
            return out
        while True:
            self.ws()
            if self.i >= len(self.s) or self.s[self.i] != '"':
                raise JSONError("expected a string key", self.i)
            key = self.string()
            self.ws()
            self.expect(":")
            out[key] = self.value()
            self.ws()
            if self.i < len(self.s) and self.s[self.i] == ",":
                self.i += 1
                continue
            self.expect("}")
            return out

    def arr(self) -> list:
        self.i += 1
        out = []
        self.ws()
        if self.i < len(self.s) and self.s[self.i] == "]":
            self.i += 1
            return out
        while True:
            out.append(self.value())
            self.ws()
            if self.i < len(self.s) and self.s[self.i] == ",":
                self.i += 1
                continue
            self.expect("]")
            return out

    def hex4(self) -> int:
        chunk = self.s[self.i:self.i + 4]
        if len(chunk) != 4 or any(c not in "0123456789abcdefABCDEF" for c in chunk):
            raise JSONError("bad \\u escape", self.i)
        self.i += 4
        return int(chunk, 16)

    def string(self) -> str:
        self.i += 1
        out = []
        while True:
            if self.i >= len(self.s):
                raise JSONError("unterminated string", self.i)
            ch = self.s[self.i]
            if ch == '"':
                self.i += 1
                return "".join(out)
            if ord(ch) < 0x20:
                raise JSONError("control character in string", self.i)
            if ch != "\\":
                out.append(ch)
                self.i += 1
                continue
            self.i += 1
            esc = self.s[self.i] if self.i < len(self.s) else ""
            if esc in _ESCAPES:
                out.append(_ESCAPES[esc])
                self.i += 1
            elif esc == "u":
                self.i += 1
                code = self.hex4()
                if 0xD800 <= code < 0xDC00 and self.s.startswith("\\u", self.i):
                    save = self.i
                    self.i += 2
                    low = self.hex4()
                    if 0xDC00 <= low < 0xE000:
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    else:
                        self.i = save
                out.append(chr(code))
            else:
                raise JSONError("bad escape", self.i)


def loads(text: str):
    parser = _Parser(text)
    value = parser.value()
    parser.ws()
    if parser.i != len(text):
        raise JSONError("extra data", parser.i)
    return value
