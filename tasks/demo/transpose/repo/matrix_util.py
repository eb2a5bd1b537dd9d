def transpose(matrix: list[list]) -> list[list]:
    raise NotImplementedError
