from shop import run  # noqa: F401 (left over)


def total(values):
    return sum(values)
