class Autocomplete:
    def add(self, word: str, weight: int = 1) -> None:
        raise NotImplementedError

    def remove(self, word: str) -> None:
        raise NotImplementedError

    def complete(self, prefix: str, k: int = 5) -> list[str]:
        raise NotImplementedError

    def weight(self, word: str) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, word: str) -> bool:
        raise NotImplementedError
