import heapq


class _Node:
    __slots__ = ("children", "weight")

    def __init__(self) -> None:
        self.children: dict[str, "_Node"] = {}
        self.weight: int | None = None  # None: no word ends here


class Autocomplete:
    def __init__(self) -> None:
        self._root = _Node()
        self._count = 0

    def _find(self, text: str) -> _Node | None:
        node = self._root
        for ch in text:
            node = node.children.get(ch)
            if node is None:
                return None
        return node

    def add(self, word: str, weight: int = 1) -> None:
        if not word:
            raise ValueError("empty word")
        node = self._root
        for ch in word:
            node = node.children.setdefault(ch, _Node())
        if node.weight is None:
            node.weight = 0
            self._count += 1
        node.weight += weight

    def remove(self, word: str) -> None:
        path = [self._root]
        for ch in word:
            nxt = path[-1].children.get(ch)
            if nxt is None:
                raise KeyError(word)
            path.append(nxt)
        if not word or path[-1].weight is None:
            raise KeyError(word)
        path[-1].weight = None
        self._count -= 1
        # prune branches no word uses any more
        for i in range(len(word), 0, -1):
            node = path[i]
            if node.weight is None and not node.children:
                del path[i - 1].children[word[i - 1]]
            else:
                break

    def complete(self, prefix: str, k: int = 5) -> list[str]:
        start = self._find(prefix)
        if start is None or k <= 0:
            return []
        found = []
        stack = [(start, prefix)]
        while stack:
            node, text = stack.pop()
            if node.weight is not None:
                found.append((-node.weight, text))
            for ch, child in node.children.items():
                stack.append((child, text + ch))
        return [w for _, w in heapq.nsmallest(k, found)]

    def weight(self, word: str) -> int:
        node = self._find(word)
        if node is None or node.weight is None or not word:
            raise KeyError(word)
        return node.weight

    def __len__(self) -> int:
        return self._count

    def __contains__(self, word: str) -> bool:
        node = self._find(word)
        return bool(word) and node is not None and node.weight is not None
