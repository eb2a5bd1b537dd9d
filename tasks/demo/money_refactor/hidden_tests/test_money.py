import inspect
from decimal import Decimal

import pytest


def test_parse_money_accepts():
    from money import parse_money

    assert parse_money("$1,234.50") == Decimal("1234.50")
    assert parse_money(" 12 ") == Decimal("12")
    assert parse_money("0.5") == Decimal("0.5")
    assert parse_money("$1,000,000") == Decimal("1000000")


@pytest.mark.parametrize("bad", ["", "$", "1.234", "12,34", "-5", "1,2345", "$$5", "5$", "abc", "1.2.3"])
def test_parse_money_rejects(bad):
    from money import parse_money

    with pytest.raises(ValueError):
        parse_money(bad)


def test_orders_uses_the_shared_parser():
    import money
    import orders

    assert orders.parse_money is money.parse_money
    source = inspect.getsource(orders)
    assert "replace(" not in source and "lstrip(" not in source


def test_order_total():
    from orders import order_total

    assert order_total([("$1,234.50", 2), ("0.25", 4)]) == Decimal("2470.00")
    assert order_total([]) == Decimal("0")


def test_most_expensive_with_separators():
    from orders import most_expensive

    assert most_expensive({"pen": "$2.50", "laptop": "$1,299.00", "desk": "$350"}) == "laptop"


def test_bad_price_in_order_raises():
    from orders import order_total

    with pytest.raises(ValueError):
        order_total([("free", 1)])
