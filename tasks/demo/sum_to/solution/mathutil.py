def sum_to(n: int) -> int:
    """Return 1 + 2 + ... + n (0 when n <= 0)."""
    if n <= 0:
        return 0
    return n * (n + 1) // 2
