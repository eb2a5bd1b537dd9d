class InsufficientFunds(Exception):
    pass


def _check_amount(amount: int) -> None:
    if amount <= 0:
        raise ValueError(f"amount must be positive, got {amount}")


class Account:
    def __init__(self, owner: str, balance: int = 0) -> None:
        self.owner = owner
        self.balance = balance
        self.history: list[tuple[str, int]] = []

    def deposit(self, amount: int, kind: str = "deposit") -> None:
        _check_amount(amount)
        self.balance += amount
        self.history.append((kind, amount))

    def withdraw(self, amount: int, kind: str = "withdraw") -> None:
        _check_amount(amount)
        if amount > self.balance:
            raise InsufficientFunds(f"{self.owner} cannot pay {amount}")
        self.balance -= amount
        self.history.append((kind, amount))
