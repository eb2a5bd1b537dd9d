def slugify(title: str, max_length: int | None = None) -> str:
    raise NotImplementedError
