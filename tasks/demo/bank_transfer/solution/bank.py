from account import Account


def transfer(source: Account, target: Account, amount: int) -> None:
    if source is target:
        raise ValueError("cannot transfer to the same account")
    # Withdraw first: it validates the amount and the balance before anything moves.
    source.withdraw(amount, kind="transfer_out")
    target.deposit(amount, kind="transfer_in")
