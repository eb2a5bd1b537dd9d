from wordfreq import top_words


def test_counts_case_insensitively():
    assert top_words("The cat and the hat. THE END", 1) == [("the", 3)]


def test_ties_alphabetical():
    assert top_words("b a c b a c d", 3) == [("a", 2), ("b", 2), ("c", 2)]


def test_apostrophes_and_punctuation():
    text = "Don't stop; don't quit -- it's 2024, it's time!"
    assert top_words(text, 2) == [("don't", 2), ("it's", 2)]


def test_fewer_words_than_n():
    assert top_words("one two", 5) == [("one", 1), ("two", 1)]
    assert top_words("", 3) == []
