import pytest

from toposort import CycleError, build_order


def test_simple_chain():
    assert build_order({"app": ["lib"], "lib": ["core"]}) == ["core", "lib", "app"]


def test_alphabetical_among_ready():
    deps = {"d": ["b", "c"], "c": ["a"], "b": ["a"], "e": []}
    assert build_order(deps) == ["a", "b", "c", "d", "e"]


def test_implicit_leaves_and_empty():
    assert build_order({"x": ["z", "y"]}) == ["y", "z", "x"]
    assert build_order({}) == []


def test_respects_every_edge():
    deps = {f"n{i}": [f"n{j}" for j in range(i) if (i * j) % 7 == 1] for i in range(60)}
    order = build_order(deps)
    pos = {n: i for i, n in enumerate(order)}
    assert sorted(order) == sorted(deps)
    assert all(pos[d] < pos[n] for n, ds in deps.items() for d in ds)


def _rotations(cycle):
    return {tuple(cycle[i:] + cycle[:i]) for i in range(len(cycle))}


def test_cycle_reported():
    with pytest.raises(CycleError) as info:
        build_order({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]})
    assert tuple(info.value.cycle) in _rotations(["a", "b", "c"]) | _rotations(["a", "c", "b"])
    assert isinstance(info.value, ValueError)


def test_self_cycle():
    with pytest.raises(CycleError) as info:
        build_order({"a": ["a"]})
    assert info.value.cycle == ["a"]
