def sum_to(n: int) -> int:
    """Return 1 + 2 + ... + n (0 when n <= 0)."""
    return sum(range(n))
