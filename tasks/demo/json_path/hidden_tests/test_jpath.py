import pytest

from jpath import get_path

DATA = {
    "users": [
        {"name": "ada", "address": {"city": "London"}},
        {"name": "grace", "tags": ["navy", "cobol"]},
    ],
    "matrix": [[1, 2, 3], [4, 5, 6]],
    "meta-data": {"v_1": True},
}


def test_nested():
    assert get_path(DATA, "users[0].address.city") == "London"
    assert get_path(DATA, "users[1].tags[-1]") == "cobol"


def test_chained_indexes_and_odd_keys():
    assert get_path(DATA, "matrix[1][2]") == 6
    assert get_path(DATA, "meta-data.v_1") is True


def test_missing_with_default():
    assert get_path(DATA, "users[5].name", default="?") == "?"
    assert get_path(DATA, "users[0].phone", default=None) is None
    assert get_path(DATA, "users.name", default=0) == 0  # a list indexed by key


def test_missing_raises_keyerror():
    with pytest.raises(KeyError):
        get_path(DATA, "users[0].address.zip")
    with pytest.raises(KeyError):
        get_path(DATA, "matrix[0][3]")


@pytest.mark.parametrize("bad", ["", "a..b", "a[x]", "a[1", ".a", "a.", "a[]"])
def test_invalid_paths(bad):
    with pytest.raises(ValueError):
        get_path(DATA, bad, default=None)


def test_whole_list_value():
    assert get_path(DATA, "matrix[0]") == [1, 2, 3]
