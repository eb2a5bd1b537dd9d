import heapq


class CycleError(ValueError):
    def __init__(self, cycle: list[str]) -> None:
        super().__init__("dependency cycle: " + " -> ".join(cycle + cycle[:1]))
        self.cycle = cycle


def build_order(deps: dict[str, list[str]]) -> list[str]:
    nodes = set(deps) | {d for ds in deps.values() for d in ds}
    waiting = {n: set(deps.get(n, ())) for n in nodes}
    dependents: dict[str, list[str]] = {n: [] for n in nodes}
    for n, ds in waiting.items():
        for d in ds:
            dependents[d].append(n)
    ready = [n for n, ds in waiting.items() if not ds]
    heapq.heapify(ready)
    order = []
    while ready:
        n = heapq.heappop(ready)
        order.append(n)
        for m in dependents[n]:
            waiting[m].discard(n)
            if not waiting[m]:
                heapq.heappush(ready, m)
    if len(order) < len(nodes):
        raise CycleError(_find_cycle({n: ds for n, ds in waiting.items() if ds}))
    return order


def _find_cycle(blocked: dict[str, set[str]]) -> list[str]:
    # Every blocked node waits on another blocked node, so walking always closes a loop.
    start = min(blocked)
    path, seen = [], {}
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = min(d for d in blocked[node] if d in blocked)
    return path[seen[node]:]
