"""Thompson NFA: parse to a tree, compile to states, simulate with state sets."""


class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def parse(self):
        node = self.alternation()
        if self.i != len(self.p):
            raise ValueError(f"unbalanced ')' at {self.i}")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.i < len(self.p) and self.p[self.i] == "|":
            self.i += 1
            branches.append(self.sequence())
        return ("alt", branches) if len(branches) > 1 else branches[0]

    def sequence(self):
        items = []
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            atom = self.atom()
            while self.i < len(self.p) and self.p[self.i] in "*+?":
                atom = (self.p[self.i], atom)
                self.i += 1
            items.append(atom)
        return ("seq", items)

    def atom(self):
        ch = self.p[self.i]
        if ch in "*+?":
            raise ValueError(f"quantifier {ch!r} at {self.i} has nothing to repeat")
        self.i += 1
        if ch == "\\":
            if self.i == len(self.p):
                raise ValueError("trailing backslash")
            self.i += 1
            return ("char", self.p[self.i - 1])
        if ch == ".":
            return ("any",)
        if ch == "(":
            node = self.alternation()
            if self.i == len(self.p) or self.p[self.i] != ")":
                raise ValueError("missing ')'")
            self.i += 1
            return node
        return ("char", ch)


class _NFA:
    def __init__(self) -> None:
        self.edges: list[list] = []  # per state: list of (label or None, target)

    def state(self) -> int:
        self.edges.append([])
        return len(self.edges) - 1

    def build(self, node, start: int, end: int) -> None:
        kind = node[0]
        if kind == "char" or kind == "any":
            self.edges[start].append((node, end))
        elif kind == "seq":
            current = start
            for item in node[1]:
                nxt = self.state()
                self.build(item, current, nxt)
                current = nxt
            self.edges[current].append((None, end))
        elif kind == "alt":
            for branch in node[1]:
                self.build(branch, start, end)
        else:  # quantifiers
            inner_start, inner_end = self.state(), self.state()
            self.build(node[1], inner_start, inner_end)
            self.edges[start].append((None, inner_start))
            self.edges[inner_end].append((None, end))
            if kind in "*?":
                self.edges[start].append((None, end))
            if kind in "*+":
                self.edges[inner_end].append((None, inner_start))

    def closure(self, states: set[int]) -> set[int]:
        stack, seen = list(states), set(states)
        while stack:
            s = stack.pop()
            for label, t in self.edges[s]:
                if label is None and t not in seen:
                    seen.add(t)
                    stack.append(t)
        return seen


def fullmatch(pattern: str, text: str) -> bool:
    tree = _Parser(pattern).parse()
    nfa = _NFA()
    start, end = nfa.state(), nfa.state()
    nfa.build(tree, start, end)
    current = nfa.closure({start})
    for ch in text:
        nxt = set()
        for s in current:
            for label, t in nfa.edges[s]:
                if label is not None and (label[0] == "any" or label[1] == ch):
                    nxt.add(t)
        current = nfa.closure(nxt)
        if not current:
            return False
    return end in current
