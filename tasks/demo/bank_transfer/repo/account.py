class InsufficientFunds(Exception):
    pass


class Account:
    def __init__(self, owner: str, balance: int = 0) -> None:
        self.owner = owner
        self.balance = balance
        self.history: list[tuple[str, int]] = []

    def deposit(self, amount: int, kind: str = "deposit") -> None:
        self.balance += amount
        self.history.append((kind, amount))

    def withdraw(self, amount: int, kind: str = "withdraw") -> None:
        self.history.append((kind, amount))
        if amount > self.balance:
            raise InsufficientFunds(f"{self.owner} cannot pay {amount}")
        self.balance -= amount
