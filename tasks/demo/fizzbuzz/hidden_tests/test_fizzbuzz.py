from fizzbuzz import fizzbuzz


def test_zero():
    assert fizzbuzz(0) == []


def test_first_fifteen():
    assert fizzbuzz(15) == [
        "1", "2", "Fizz", "4", "Buzz", "Fizz", "7", "8", "Fizz", "Buzz",
        "11", "Fizz", "13", "14", "FizzBuzz",
    ]


def test_length_and_last():
    out = fizzbuzz(100)
    assert len(out) == 100
    assert out[-1] == "Buzz"
    assert out.count("FizzBuzz") == 6
