import csv
import io
from decimal import Decimal

from inventory.models import Item


class OutOfStock(Exception):
    pass


class Inventory:
    def __init__(self):
        self._items: dict[str, Item] = {}

    def add_item(self, item: Item) -> None:
        self._items[item.sku] = item

    def get(self, sku: str) -> Item:
        return self._items[sku]

    def restock(self, sku: str, quantity: int) -> None:
        self._items[sku].quantity += quantity

    def remove(self, sku: str, quantity: int) -> None:
        self._items[sku].quantity -= quantity

    def total_value(self) -> Decimal:
        return sum((i.unit_price * i.quantity for i in self._items.values()), Decimal("0"))

    def low_stock(self, threshold: int) -> list[str]:
        return list({sku for sku, i in self._items.items() if i.quantity < threshold})

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["sku", "name", "unit_price", "quantity", "tags"])
        for i in self._items.values():
            writer.writerow([i.sku, i.name, str(i.unit_price), i.quantity, ";".join(i.tags)])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> "Inventory":
        inv = cls()
        lines = text.strip().splitlines()[1:]
        for line in lines:
            sku, name, price, quantity, tags = line.split(",")
            inv.add_item(Item(sku, name, Decimal(price), int(quantity), tags.split(";") if tags else []))
        return inv
