import inspect
import itertools

import pytest

import probe


class Box:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class Rejected(Exception):
    pass


def test_total_of_a_generator():
    assert probe.total(x for x in range(10)) == 45
    assert probe.total(iter([1, 2])) == 3


def test_first_of_an_infinite_iterator():
    assert probe.first(itertools.count(5), 3) == [5, 6, 7]


def test_callbacks():
    seen = []
    assert probe.apply_all([1, 2, 3], lambda v: v * 2, seen.append) == 3
    assert seen == [2, 4, 6]


def test_test_objects_and_classes():
    assert probe.unbox(Box(7)) == 7
    built = probe.build(Box, 4)
    assert isinstance(built, Box) and built.get() == 4


def test_a_callback_error_passes_through():
    def reject(v):
        raise Rejected(f"no {v}")

    with pytest.raises(Rejected):
        probe.apply_all([1], reject, print)


def test_reads_a_file_the_test_wrote(tmp_path):
    path = tmp_path / "numbers.txt"
    path.write_text("3\n4\n")
    assert probe.sum_file(path) == 7
    assert probe.sum_file(str(path)) == 7


def test_writes_a_file_the_test_reads(tmp_path):
    out = tmp_path / "square.txt"
    probe.write_square(out, 12)
    assert out.read_text() == "144"


def test_numbers():
    assert probe.mean([1, 2, 3, 4]) == 2.5
    assert list(probe.scale([1, 2], 3)) == [3, 6]
    assert probe.power(7, 20000) == 7 ** 20000
    assert probe.power(2, 10) == 1024


def test_depth():
    assert probe.depth([]) == 1
    assert probe.depth([[[[]]], []]) == 4


def test_no_eval_in_the_source():
    source = inspect.getsource(probe)
    assert "def total" in source and "eval(" not in source
