def greet(name: str) -> str:
    name = name.strip()
    return f"Hello, {name or 'stranger'}!"
