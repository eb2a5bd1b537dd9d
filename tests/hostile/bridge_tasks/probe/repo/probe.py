def total(items):
    """The sum of the numbers ``items`` yields."""
    raise NotImplementedError


def first(iterator, n):
    """The first ``n`` items of ``iterator`` (possibly infinite), as a list."""
    raise NotImplementedError


def apply_all(values, transform, collect):
    """Call ``collect(transform(v))`` for each value in order; return how many."""
    raise NotImplementedError


def unbox(box):
    """``box.get()``."""
    raise NotImplementedError


def build(cls, value):
    """A new ``cls(value)``."""
    raise NotImplementedError


def sum_file(path):
    """The sum of the integers in the text file at ``path``, one per line."""
    raise NotImplementedError


def write_square(path, n):
    """Write ``n * n`` (decimal) into the file at ``path``."""
    raise NotImplementedError


def mean(values):
    """The arithmetic mean of ``values``."""
    raise NotImplementedError


def scale(values, k):
    """Each value times ``k``, in order."""
    raise NotImplementedError


def power(base, exponent):
    """``base ** exponent`` (exactly)."""
    raise NotImplementedError


def depth(nested):
    """How deeply lists nest in ``nested`` (``[]`` is 1, ``[[]]`` is 2)."""
    raise NotImplementedError
