"""Hidden checks for Lab 02 (instructor only; not in the student bundle): ties, empty queues, edge budgets."""
from llmso_lab.grading.registry import hidden
from llmso_lab.grading.specs.lab02 import INF, req

_tie = [req("x", 1.0, 1, 64), req("y", 1.0, 1, 64), req("z", 0.0, 1, 64)]   # same key but for the list position
hidden("02", {
    "plan_token_budget": [
        ((["d"], [("a", 7), ("b", 4)], 8), {}),                                  # budget exactly exhausted by 'a'
        ((["d"], [("a", 7), ("b", 4)], 8), {"enable_chunked_prefill": False}),
        ((["d1", "d2"], [("a", 50), ("b", 3)], 40), {"enable_chunked_prefill": False}),   # larger than the leftover
        ((list(range(6)), [("p", 9)], 4), {}),                                   # fewer tokens than decodes
        (([], [], 16), {}),                                                      # nothing to do
        ((["d"], [], 16), {}),                                                   # decodes only
        ((["d1", "d2"], [("a", 1), ("b", 1), ("c", 1)], 100), {"max_num_seqs": 4}),
        (([7, 8], [(9, 30)], 2), {}),                                            # decodes use the whole budget
        (([], [("a", 64), ("b", 64), ("c", 1)], 128), {"enable_chunked_prefill": False}),   # exactly two whole prompts
        ((["d1", "d2", "d3"], [("a", 5)], 100), {"max_num_seqs": 2}),            # max_num_seqs cuts the decodes
    ],
    "choose_victim": [
        (([], "fcfs"), {}),                                                      # nothing running
        ((_tie, "fcfs"), {}),                                                    # arrival tie: later list position
        ((_tie, "priority"), {}),
        ((_tie, "sjf"), {}),
        (([req("only", 3.0, 5, 10)], "priority"), {}),
        (([req("p", 0.0, 0, 10), req("q", 9.0, -1, 10)], "priority"), {}),     # a negative priority is served first
        (([req("old", 0.0, 0, 400), req("new", 10.0, 0, 100)], "sjf"), {"now": 10.0, "aging": 40.0}),   # aged: 0 < 100
        (([req("old", 0.0, 0, 400), req("new", 10.0, 0, 100)], "sjf"), {"now": 10.0, "aging": 10.0}),
    ],
    "sjf_order": [
        (([],), {}),                                                             # empty queue
        ((_tie,), {}),                                                           # ties by arrival, then position
        (([req("long", 0.0, predicted_len=300), req("s1", 5.0, predicted_len=100)],), {"now": 5.0, "aging": 40.0}),
        (([req("long", 0.0, predicted_len=300), req("s1", 5.0, predicted_len=100)],), {"now": 5.0, "aging": 20.0}),
        (([req("future", 9.0, predicted_len=10), req("now", 1.0, predicted_len=10)],), {"now": 2.0, "aging": 1.0}),
        (([req("x", 1.0, predicted_len=14), req("future", 9.0, predicted_len=10)],), {"now": 2.0, "aging": 1.0}),  # no negative credit
        (([req(i, float(i), predicted_len=float(64 - 8 * i)) for i in range(6)],), {"now": 4.0, "aging": 8.0}),
        (([req("a", 2.0, 9, 30), req("b", 0.0, 0, 30), req("c", 1.0, 0, 28)],), {"now": 1.0, "aging": 2.0}),
    ],
    "histogram_quantile": [
        ((0.0, [[0.5, 3.0], [1.0, 6.0], [INF, 6.0]]), {}),                  # q = 0: the bottom of the first bucket
        ((1.0, [[0.5, 3.0], [1.0, 6.0], [INF, 6.0]]), {}),                  # q = 1: the top of the last finite one
        ((0.5, [[0.5, 3.0], [1.0, 6.0], [INF, 6.0]]), {}),                  # exactly on a bucket boundary
        ((0.75, [[0.01, 0.0], [0.02, 0.0], [0.04, 8.0], [INF, 8.0]]), {}),  # empty buckets below
        ((0.3, [[-1.0, 4.0], [0.0, 8.0], [INF, 10.0]]), {}),               # a non-positive first bound is returned
        ((1.5, [[1.0, 1.0], [INF, 1.0]]), {}),                              # q > 1: +Inf
        ((-0.1, [[1.0, 1.0], [INF, 1.0]]), {}),                             # q < 0: -Inf
        ((0.5, [[INF, 4.0]]), {}),                                          # only +Inf: NaN
        ((0.95, [[0.001, 1.0], [0.005, 4.0], [0.01, 9.0], [0.02, 30.0], [0.04, 31.0], [INF, 31.0]]), {}),
    ],
})
