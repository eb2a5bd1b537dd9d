MISSING = object()


def get_path(data, path: str, default=MISSING):
    raise NotImplementedError
