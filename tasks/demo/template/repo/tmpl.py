def render(template: str, context: dict) -> str:
    raise NotImplementedError
