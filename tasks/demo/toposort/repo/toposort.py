class CycleError(ValueError):
    def __init__(self, cycle: list[str]) -> None:
        super().__init__("dependency cycle: " + " -> ".join(cycle + cycle[:1]))
        self.cycle = cycle


def build_order(deps: dict[str, list[str]]) -> list[str]:
    raise NotImplementedError
