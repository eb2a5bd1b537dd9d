class CycleError(ValueError):
    pass


class Sheet:
    def set(self, cell: str, content) -> None:
        raise NotImplementedError

    def get(self, cell: str) -> float:
        raise NotImplementedError
