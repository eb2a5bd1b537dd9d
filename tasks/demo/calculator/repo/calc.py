def evaluate(expression: str) -> float:
    raise NotImplementedError
