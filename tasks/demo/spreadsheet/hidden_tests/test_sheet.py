import pytest

from sheet import CycleError, Sheet


def test_values_and_empty_cells():
    s = Sheet()
    s.set("A1", 3)
    s.set("a2", "4.5")
    assert s.get("A1") == 3
    assert s.get("A2") == 4.5
    assert s.get("Z99") == 0


def test_formula_precedence_and_parentheses():
    s = Sheet()
    s.set("A1", 2)
    s.set("A2", 3)
    s.set("B1", "=A1 + A2 * 4")
    s.set("B2", "=(A1 + A2) * 4")
    s.set("B3", "=-A1 - -A2 / 2")
    assert s.get("B1") == 14
    assert s.get("B2") == 20
    assert s.get("b3") == -0.5


def test_dependencies_update():
    s = Sheet()
    s.set("A1", 1)
    s.set("B1", "=A1 * 10")
    s.set("C1", "=B1 + 1")
    assert s.get("C1") == 11
    s.set("A1", 5)
    assert s.get("C1") == 51
    s.set("B1", 7)
    assert s.get("C1") == 8


def test_sum_ranges():
    s = Sheet()
    for i, v in enumerate([1, 2, 3, 4], start=1):
        s.set(f"A{i}", v)
    s.set("B1", 10)
    s.set("B2", "=A1 * 100")
    s.set("C1", "=SUM(A1:A4)")
    s.set("C2", "=SUM(A1:B2) + SUM(B2:A1)")  # rectangles, either corner order
    s.set("AA10", "=SUM(A3:A9)")
    assert s.get("C1") == 10
    assert s.get("C2") == 2 * (1 + 2 + 10 + 100)
    assert s.get("AA10") == 7


def test_cycles_rejected_and_previous_content_kept():
    s = Sheet()
    s.set("A1", "=B1 + 1")
    s.set("B1", 1)
    with pytest.raises(CycleError):
        s.set("B1", "=A1 * 2")
    assert s.get("A1") == 2
    with pytest.raises(CycleError):
        s.set("C1", "=C1")
    with pytest.raises(CycleError):
        s.set("B1", "=SUM(A1:A3)")
    assert s.get("B1") == 1


def test_errors():
    s = Sheet()
    for bad in ["=1 +", "=(A1", "=A1 $ 2", "=SUM(A1)", "=A1:A3"]:
        with pytest.raises(ValueError):
            s.set("A5", bad)
    for bad_name in ["1A", "A0", "A", ""]:
        with pytest.raises(ValueError):
            s.set(bad_name, 1)
    with pytest.raises(ValueError):
        s.set("A1", "hello")
    s.set("D1", "=1 / (2 - 2)")
    with pytest.raises(ZeroDivisionError):
        s.get("D1")
