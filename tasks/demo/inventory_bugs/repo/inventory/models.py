from decimal import Decimal


class Item:
    def __init__(self, sku: str, name: str, unit_price: Decimal, quantity: int = 0, tags=[]):
        self.sku = sku
        self.name = name
        self.unit_price = Decimal(unit_price)
        self.quantity = quantity
        self.tags = tags

    def __eq__(self, other):
        if not isinstance(other, Item):
            return NotImplemented
        return (self.sku, self.name, self.unit_price, self.quantity, self.tags) == (
            other.sku, other.name, other.unit_price, other.quantity, other.tags)

    def __repr__(self):
        return f"Item({self.sku!r}, {self.name!r}, {self.unit_price!r}, {self.quantity!r}, {self.tags!r})"
