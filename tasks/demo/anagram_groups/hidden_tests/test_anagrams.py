from anagrams import group_anagrams


def test_example():
    words = ["eat", "tea", "tan", "ate", "nat", "bat"]
    assert group_anagrams(words) == [["ate", "eat", "tea"], ["bat"], ["nat", "tan"]]


def test_empty():
    assert group_anagrams([]) == []


def test_case_insensitive_grouping_keeps_original_words():
    assert group_anagrams(["Listen", "silent", "enlist", "google"]) == [
        ["Listen", "enlist", "silent"], ["google"],
    ]


def test_duplicates_kept():
    assert group_anagrams(["ab", "ba", "ab"]) == [["ab", "ab", "ba"]]
