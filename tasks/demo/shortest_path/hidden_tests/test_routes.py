import random

import pytest

from routes import shortest_path

GRAPH = {
    "a": {"b": 7, "c": 9, "f": 14},
    "b": {"a": 7, "c": 10, "d": 15},
    "c": {"a": 9, "b": 10, "d": 11, "f": 2},
    "d": {"b": 15, "c": 11, "e": 6},
    "e": {"d": 6, "f": 9},
    "f": {"a": 14, "c": 2, "e": 9},
}


def _valid(graph, path, cost):
    total = sum(graph[u][v] for u, v in zip(path, path[1:]))
    return total == cost


def test_classic_example():
    cost, path = shortest_path(GRAPH, "a", "e")
    assert cost == 20
    assert path == ["a", "c", "f", "e"]


def test_same_node_and_unreachable():
    assert shortest_path(GRAPH, "a", "a") == (0, ["a"])
    g = {"x": {"y": 1}, "z": {"x": 1}}
    assert shortest_path(g, "x", "z") is None
    assert shortest_path(g, "y", "x") is None  # y only appears as a neighbour


def test_float_weights_and_zero_edges():
    g = {1: {2: 0.5, 3: 2.0}, 2: {3: 0.25}, 3: {4: 0}}
    assert shortest_path(g, 1, 4) == (0.75, [1, 2, 3, 4])


def test_errors():
    with pytest.raises(ValueError):
        shortest_path({"a": {"b": -1}}, "a", "b")
    with pytest.raises(KeyError):
        shortest_path({"a": {"b": 1}}, "q", "b")


def test_ties_any_valid_path():
    g = {"s": {"x": 1, "y": 1}, "x": {"t": 1}, "y": {"t": 1}}
    cost, path = shortest_path(g, "s", "t")
    assert cost == 2 and path in (["s", "x", "t"], ["s", "y", "t"])


def test_large_random_graph_against_bellman_ford():
    rng = random.Random(3)
    n = 2000
    g = {i: {} for i in range(n)}
    for _ in range(50_000):
        u, v = rng.randrange(n), rng.randrange(n)
        g[u][v] = rng.randrange(1, 100)
    cost, path = shortest_path(g, 0, n - 1)
    assert path[0] == 0 and path[-1] == n - 1 and _valid(g, path, cost)
    # reference distances for a few targets by a simple (slow but correct) relaxation
    dist = {0: 0}
    frontier = {0}
    while frontier:
        nxt = set()
        for u in frontier:
            for v, w in g[u].items():
                if dist[u] + w < dist.get(v, float("inf")):
                    dist[v] = dist[u] + w
                    nxt.add(v)
        frontier = nxt
    assert cost == dist[n - 1]
    for target in (5, 77, 1234):
        assert shortest_path(g, 0, target)[0] == dist[target]
