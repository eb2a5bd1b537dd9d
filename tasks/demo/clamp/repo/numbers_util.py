def clamp(x: float, lo: float, hi: float) -> float:
    raise NotImplementedError
