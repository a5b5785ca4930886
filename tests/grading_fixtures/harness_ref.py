"""A toy harness exercise for test_grading: the reference `square`, run by `run_on_two` as a library harness runs
a student's drafter or eviction policy."""


def square(x):
    return x * x


def run_on_two(fn, x):
    return [fn(x), fn(x + 1)]
