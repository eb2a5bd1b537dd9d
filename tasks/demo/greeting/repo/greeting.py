def greet(name: str) -> str:
    return "Helo, " + name
