from decimal import Decimal


def apply_discount(price: Decimal, percent: float) -> Decimal:
    """Price after taking `percent` off, rounded to the cent."""
    return Decimal(str(round(float(price) * (100 - percent) / 100, 2)))
