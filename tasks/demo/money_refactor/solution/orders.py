from decimal import Decimal

from money import parse_money


def order_total(lines: list[tuple[str, int]]) -> Decimal:
    """Sum of price * quantity over (price text, quantity) lines."""
    return sum((parse_money(price_text) * quantity for price_text, quantity in lines), Decimal("0"))


def most_expensive(prices: dict[str, str]) -> str:
    """Name of the item with the highest price."""
    best_name, best_price = None, None
    for name, price_text in prices.items():
        price = parse_money(price_text)
        if best_price is None or price > best_price:
            best_name, best_price = name, price
    return best_name
