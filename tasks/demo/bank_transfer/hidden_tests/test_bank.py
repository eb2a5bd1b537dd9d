import pytest

from account import Account, InsufficientFunds
from bank import transfer


def test_successful_transfer():
    a, b = Account("a", 100), Account("b", 5)
    transfer(a, b, 30)
    assert (a.balance, b.balance) == (70, 35)
    assert a.history == [("transfer_out", 30)]
    assert b.history == [("transfer_in", 30)]


def test_insufficient_funds_changes_nothing():
    a, b = Account("a", 10), Account("b", 0)
    with pytest.raises(InsufficientFunds):
        transfer(a, b, 11)
    assert (a.balance, b.balance) == (10, 0)
    assert a.history == [] and b.history == []


def test_withdraw_failure_records_nothing():
    a = Account("a", 1)
    with pytest.raises(InsufficientFunds):
        a.withdraw(2)
    assert a.history == [] and a.balance == 1


@pytest.mark.parametrize("amount", [0, -5])
def test_non_positive_amounts(amount):
    a, b = Account("a", 100), Account("b", 100)
    for op in (lambda: a.deposit(amount), lambda: a.withdraw(amount), lambda: transfer(a, b, amount)):
        with pytest.raises(ValueError):
            op()
    assert (a.balance, b.balance) == (100, 100)
    assert a.history == [] and b.history == []


def test_same_account():
    a = Account("a", 50)
    with pytest.raises(ValueError):
        transfer(a, a, 10)
    assert a.balance == 50 and a.history == []


def test_plain_operations_history():
    a = Account("a")
    a.deposit(10)
    a.withdraw(4)
    assert a.balance == 6
    assert a.history == [("deposit", 10), ("withdraw", 4)]
