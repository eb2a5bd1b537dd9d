def shortest_path(graph: dict, start, goal):
    raise NotImplementedError
