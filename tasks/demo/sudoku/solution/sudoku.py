DIGITS = set(range(1, 10))


def _box(r: int, c: int) -> int:
    return (r // 3) * 3 + c // 3


def _validate(grid) -> None:
    if len(grid) != 9 or any(len(row) != 9 for row in grid):
        raise ValueError("grid must be 9x9")
    rows, cols, boxes = [set() for _ in range(9)], [set() for _ in range(9)], [set() for _ in range(9)]
    for r in range(9):
        for c in range(9):
            v = grid[r][c]
            if not isinstance(v, int) or not 0 <= v <= 9:
                raise ValueError(f"bad value {v!r} at ({r}, {c})")
            if v:
                for seen in (rows[r], cols[c], boxes[_box(r, c)]):
                    if v in seen:
                        raise ValueError(f"{v} repeated at ({r}, {c})")
                    seen.add(v)


def solve(grid: list[list[int]]) -> list[list[int]] | None:
    _validate(grid)
    board = [row[:] for row in grid]
    rows = [set(board[r]) - {0} for r in range(9)]
    cols = [{board[r][c] for r in range(9)} - {0} for c in range(9)]
    boxes = [set() for _ in range(9)]
    empty = []
    for r in range(9):
        for c in range(9):
            if board[r][c]:
                boxes[_box(r, c)].add(board[r][c])
            else:
                empty.append((r, c))

    def search() -> bool:
        if not empty:
            return True
        # most constrained cell first
        best_i, best_options = -1, None
        for i, (r, c) in enumerate(empty):
            options = DIGITS - rows[r] - cols[c] - boxes[_box(r, c)]
            if best_options is None or len(options) < len(best_options):
                best_i, best_options = i, options
                if len(options) <= 1:
                    break
        r, c = empty.pop(best_i)
        b = _box(r, c)
        for v in sorted(best_options):
            board[r][c] = v
            rows[r].add(v), cols[c].add(v), boxes[b].add(v)
            if search():
                return True
            rows[r].discard(v), cols[c].discard(v), boxes[b].discard(v)
        board[r][c] = 0
        empty.insert(best_i, (r, c))
        return False

    return board if search() else None
