import re
from decimal import Decimal

_MONEY = re.compile(r"\$?(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d{1,2}))?")


def parse_money(text: str) -> Decimal:
    match = _MONEY.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not an amount of money: {text!r}")
    whole, cents = match.groups()
    return Decimal(whole.replace(",", "") + ("." + cents if cents else ""))
