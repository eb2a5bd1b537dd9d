def total(items):
    return sum(items)


def first(iterator, n):
    out = []
    for item in iterator:
        if len(out) == n:
            break
        out.append(item)
    return out


def apply_all(values, transform, collect):
    count = 0
    for v in values:
        collect(transform(v))
        count += 1
    return count


def unbox(box):
    return box.get()


def build(cls, value):
    return cls(value)


def sum_file(path):
    with open(path) as f:
        return sum(int(line) for line in f if line.strip())


def write_square(path, n):
    with open(path, "w") as f:
        f.write(str(n * n))


def mean(values):
    return sum(values) / len(values)


def scale(values, k):
    return [v * k for v in values]


def power(base, exponent):
    return base ** exponent


def depth(nested):
    if not isinstance(nested, list):
        return 0
    return 1 + max((depth(x) for x in nested), default=0)
