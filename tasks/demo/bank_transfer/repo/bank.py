from account import Account


def transfer(source: Account, target: Account, amount: int) -> None:
    target.deposit(amount, kind="transfer_in")
    source.withdraw(amount, kind="transfer_out")
