def clamp(x: float, lo: float, hi: float) -> float:
    if lo > hi:
        raise ValueError(f"lo ({lo}) is greater than hi ({hi})")
    return min(max(x, lo), hi)
