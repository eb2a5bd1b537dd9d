from inventory.models import Item
from inventory.pricing import apply_discount
from inventory.store import Inventory, OutOfStock

__all__ = ["Item", "Inventory", "OutOfStock", "apply_discount"]
