import copy

import pytest

from sudoku import solve


def parse(text):
    digits = [int(ch) if ch.isdigit() else 0 for ch in text if ch.isdigit() or ch == "."]
    assert len(digits) == 81
    return [digits[i:i + 9] for i in range(0, 81, 9)]


EASY = parse("53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79")
HARD = parse("8..........36......7..9.2...5...7.......457.....1...3...1....68..85...1..9....4..")


def is_valid_solution(puzzle, solution):
    for r in range(9):
        for c in range(9):
            if puzzle[r][c] and puzzle[r][c] != solution[r][c]:
                return False
    units = [row for row in solution]
    units += [[solution[r][c] for r in range(9)] for c in range(9)]
    units += [[solution[br + r][bc + c] for r in range(3) for c in range(3)] for br in (0, 3, 6) for bc in (0, 3, 6)]
    return all(sorted(u) == list(range(1, 10)) for u in units)


def test_easy():
    solution = solve(EASY)
    assert solution[0] == [5, 3, 4, 6, 7, 8, 9, 1, 2]
    assert is_valid_solution(EASY, solution)


def test_hard():
    assert is_valid_solution(HARD, solve(HARD))


def test_input_not_modified():
    before = copy.deepcopy(EASY)
    solve(EASY)
    assert EASY == before


def test_already_solved_and_empty_grid():
    solved = solve(EASY)
    assert solve(solved) == solved
    assert is_valid_solution([[0] * 9 for _ in range(9)], solve([[0] * 9 for _ in range(9)]))


def test_unsolvable_returns_none():
    # no rule broken yet, but the top-left cell has no candidate: row has 1-6,
    # column has 7-8, box has 9
    grid = [[0] * 9 for _ in range(9)]
    grid[0][3:9] = [1, 2, 3, 4, 5, 6]
    grid[3][0], grid[6][0] = 7, 8
    grid[1][1] = 9
    assert solve(grid) is None


@pytest.mark.parametrize(
    "grid",
    [
        [[0] * 9 for _ in range(8)],
        [[0] * 8 for _ in range(9)],
        [[10] + [0] * 8] + [[0] * 9 for _ in range(8)],
        [[5, 5] + [0] * 7] + [[0] * 9 for _ in range(8)],
        [[5] + [0] * 8, [0] * 9, [0] * 9, [0] * 9, [5] + [0] * 8] + [[0] * 9 for _ in range(4)],
        [[1, 0, 0] + [0] * 6, [0, 1, 0] + [0] * 6] + [[0] * 9 for _ in range(7)],
    ],
)
def test_invalid_grids(grid):
    with pytest.raises(ValueError):
        solve(grid)
