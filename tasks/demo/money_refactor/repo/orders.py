from decimal import Decimal


def order_total(lines: list[tuple[str, int]]) -> Decimal:
    """Sum of price * quantity over (price text, quantity) lines."""
    total = Decimal("0")
    for price_text, quantity in lines:
        text = price_text.strip().lstrip("$").replace(",", "")
        total += Decimal(text) * quantity
    return total


def most_expensive(prices: dict[str, str]) -> str:
    """Name of the item with the highest price."""
    best_name, best_price = None, None
    for name, price_text in prices.items():
        price = Decimal(price_text.strip().lstrip("$"))
        if best_price is None or price > best_price:
            best_name, best_price = name, price
    return best_name
