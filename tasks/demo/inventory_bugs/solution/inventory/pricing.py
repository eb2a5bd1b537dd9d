from decimal import ROUND_HALF_UP, Decimal

CENT = Decimal("0.01")


def apply_discount(price: Decimal, percent: float) -> Decimal:
    """Price after taking `percent` off, rounded half-up to the cent."""
    percent = Decimal(str(percent))
    if not 0 <= percent <= 100:
        raise ValueError(f"percent must be within 0..100, got {percent}")
    return (Decimal(price) * (100 - percent) / 100).quantize(CENT, rounding=ROUND_HALF_UP)
