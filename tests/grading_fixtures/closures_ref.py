"""References a tripwire must still catch: a closure and a function behind a functools decorator."""
import functools


def _make(factor):
    def scaled(x):
        return factor * x
    return scaled


scaled = _make(2)


@functools.lru_cache(maxsize=None)
def cached_square(x):
    return x * x
