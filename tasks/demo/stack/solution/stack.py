class Stack:
    def __init__(self, items=()):
        self._items = list(items)

    def push(self, item) -> None:
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("empty stack")
        return self._items.pop()

    def peek(self):
        if not self._items:
            raise IndexError("empty stack")
        return self._items[-1]

    def is_empty(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return reversed(self._items)
