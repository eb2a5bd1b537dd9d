from __future__ import annotations

import re


class CycleError(ValueError):
    pass


_CELL = re.compile(r"([A-Z]+)([1-9]\d*)")
_TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|([A-Za-z]+[0-9]+(?::[A-Za-z]+[0-9]+)?)|(SUM|sum)\b|(.))")


def _cell_name(name: str) -> str:
    name = name.upper()
    if not _CELL.fullmatch(name):
        raise ValueError(f"bad cell name {name!r}")
    return name


def _col_number(letters: str) -> int:
    n = 0
    for ch in letters:
        n = n * 26 + ord(ch) - 64
    return n


def _col_letters(n: int) -> str:
    out = ""
    while n:
        n, r = divmod(n - 1, 26)
        out = chr(65 + r) + out
    return out


def _expand_range(a: str, b: str) -> list[str]:
    ca, ra = _CELL.fullmatch(a).groups()
    cb, rb = _CELL.fullmatch(b).groups()
    c1, c2 = sorted((_col_number(ca), _col_number(cb)))
    r1, r2 = sorted((int(ra), int(rb)))
    return [f"{_col_letters(c)}{r}" for c in range(c1, c2 + 1) for r in range(r1, r2 + 1)]


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        number, ref, func, other = match.groups()
        pos = match.end()
        if number:
            tokens.append(("num", number))
        elif func:
            tokens.append(("sum", func))
        elif ref:
            tokens.append(("ref", ref.upper()))
        elif other in "+-*/():":
            tokens.append(("op", other))
        else:
            raise ValueError(f"unexpected {other!r} in formula")
    return tokens


class _Parser:
    """Formula text -> a tree of tuples, checked at set() time."""

    def __init__(self, tokens) -> None:
        self.tokens, self.i = tokens, 0

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else (None, None)

    def take(self, kind=None, value=None):
        tok = self.peek()
        if tok[0] is None or (kind and tok[0] != kind) or (value and tok[1] != value):
            raise ValueError(f"malformed formula near token {self.i}")
        self.i += 1
        return tok

    def parse(self):
        tree = self.expr()
        if self.i != len(self.tokens):
            raise ValueError("malformed formula: extra input")
        return tree

    def expr(self):
        node = self.term()
        while self.peek() in (("op", "+"), ("op", "-")):
            node = (self.take()[1], node, self.term())
        return node

    def term(self):
        node = self.unary()
        while self.peek() in (("op", "*"), ("op", "/")):
            node = (self.take()[1], node, self.unary())
        return node

    def unary(self):
        if self.peek() == ("op", "-"):
            self.take()
            return ("neg", self.unary())
        return self.atom()

    def atom(self):
        kind, value = self.take()
        if kind == "num":
            return ("num", float(value) if "." in value else int(value))
        if kind == "ref":
            if ":" in value:
                raise ValueError("a range is only allowed inside SUM()")
            return ("ref", value)
        if kind == "sum":
            self.take("op", "(")
            kind, value = self.take("ref")
            if ":" not in value:
                raise ValueError("SUM needs a range like A1:B3")
            self.take("op", ")")
            return ("sum", _expand_range(*value.split(":")))
        if (kind, value) == ("op", "("):
            node = self.expr()
            self.take("op", ")")
            return node
        raise ValueError(f"unexpected {value!r} in formula")


def _refs(tree) -> set[str]:
    kind = tree[0]
    if kind == "ref":
        return {tree[1]}
    if kind == "sum":
        return set(tree[1])
    if kind == "num":
        return set()
    return set().union(*(_refs(t) for t in tree[1:]))


class Sheet:
    def __init__(self) -> None:
        self._values: dict[str, float] = {}
        self._formulas: dict[str, tuple] = {}

    def set(self, cell: str, content) -> None:
        cell = _cell_name(cell)
        if isinstance(content, str) and content.startswith("="):
            tree = _Parser(_tokenize(content[1:])).parse()
            self._check_cycle(cell, _refs(tree))
            self._formulas[cell] = tree
            self._values.pop(cell, None)
            return
        if isinstance(content, str):
            try:
                content = float(content) if any(c in content for c in ".eE") else int(content)
            except ValueError:
                raise ValueError(f"not a number: {content!r}") from None
        if isinstance(content, bool) or not isinstance(content, (int, float)):
            raise ValueError(f"unsupported content {content!r}")
        self._formulas.pop(cell, None)
        self._values[cell] = content

    def _check_cycle(self, cell: str, refs: set[str]) -> None:
        stack, seen = list(refs), set()
        while stack:
            ref = stack.pop()
            if ref == cell:
                raise CycleError(f"{cell} would depend on itself")
            if ref in seen:
                continue
            seen.add(ref)
            if ref in self._formulas:
                stack.extend(_refs(self._formulas[ref]))

    def get(self, cell: str) -> float:
        return self._eval(("ref", _cell_name(cell)))

    def _eval(self, tree):
        kind = tree[0]
        if kind == "num":
            return tree[1]
        if kind == "ref":
            name = tree[1]
            if name in self._formulas:
                return self._eval(self._formulas[name])
            return self._values.get(name, 0)
        if kind == "sum":
            return sum(self._eval(("ref", c)) for c in tree[1])
        if kind == "neg":
            return -self._eval(tree[1])
        a, b = self._eval(tree[1]), self._eval(tree[2])
        if kind == "+":
            return a + b
        if kind == "-":
            return a - b
        if kind == "*":
            return a * b
        return a / b
