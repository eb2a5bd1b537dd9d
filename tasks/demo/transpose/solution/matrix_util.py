def transpose(matrix: list[list]) -> list[list]:
    if not matrix:
        return []
    width = len(matrix[0])
    for i, row in enumerate(matrix):
        if len(row) != width:
            raise ValueError(f"row {i} has {len(row)} items, expected {width}")
    return [[row[j] for row in matrix] for j in range(width)]
