import heapq
import itertools


def shortest_path(graph: dict, start, goal):
    nodes = set(graph)
    for src, edges in graph.items():
        for dst, w in edges.items():
            if w < 0:
                raise ValueError(f"negative weight {w} on edge {src!r} -> {dst!r}")
            nodes.add(dst)
    if start not in nodes:
        raise KeyError(start)
    best = {start: 0}
    previous = {}
    tie = itertools.count()  # nodes need not be comparable
    queue = [(0, next(tie), start)]
    done = set()
    while queue:
        cost, _, node = heapq.heappop(queue)
        if node in done:
            continue
        done.add(node)
        if node == goal:
            path = [node]
            while path[-1] != start:
                path.append(previous[path[-1]])
            return cost, path[::-1]
        for nxt, w in graph.get(node, {}).items():
            c = cost + w
            if nxt not in best or c < best[nxt]:
                best[nxt] = c
                previous[nxt] = node
                heapq.heappush(queue, (c, next(tie), nxt))
    return None
