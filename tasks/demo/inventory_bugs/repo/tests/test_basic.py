from decimal import Decimal

from inventory import Inventory, Item


def test_total_value():
    inv = Inventory()
    inv.add_item(Item("A1", "bolt", Decimal("0.10"), 100))
    inv.add_item(Item("B2", "nut", Decimal("0.05"), 40))
    assert inv.total_value() == Decimal("12.00")


def test_restock():
    inv = Inventory()
    inv.add_item(Item("A1", "bolt", Decimal("0.10"), 1))
    inv.restock("A1", 9)
    assert inv.get("A1").quantity == 10
