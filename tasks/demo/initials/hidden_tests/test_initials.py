from names import initials


def test_capitalized():
    assert initials("Grace Hopper") == "G.H."


def test_lower_case():
    assert initials("alan mathison turing") == "A.M.T."


def test_repeated_spaces():
    assert initials("  ada  king lovelace ") == "A.K.L."


def test_empty():
    assert initials("") == ""
