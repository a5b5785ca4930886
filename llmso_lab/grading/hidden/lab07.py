"""Hidden checks for Lab 07 (instructor only; not in the student bundle): other sizes and seeds."""
from llmso_lab.grading.registry import hidden
from llmso_lab.grading.specs.lab07 import verify_case

hidden("07", {
    "speculative_verify": [(verify_case(5, 12, 101), {}), (verify_case(1, 3, 102), {}),
                           (verify_case(6, 9, 103, one_hot=True), {}), (verify_case(3, 40, 104), {}),
                           (verify_case(4, 8, 105, u_scale=0.3), {})],
    "greedy_verify": [(([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5]), {}), (([9, 9], [8]), {}), (([3, 3, 3], [3, 4]), {})],
    "ngram_propose": [(([1, 2, 1, 2, 1, 2], 3), {"n_min": 1, "n_max": 2}), (([9], 3), {"n_min": 1, "n_max": 4}),
                      (([2, 7, 7, 7, 7], 2), {"n_min": 2, "n_max": 3}),
                      ((list(range(20)) + [5, 6, 7], 8), {"n_min": 3, "n_max": 5})],
    "PromptLookupDrafter": [((5, 3, 3), {"seed": 11}), ((8, 1, 4), {"seed": 12, "num_kv_blocks": 48, "block_size": 8})],
    "expected_tokens_per_step": [((0.95, 8), {}), ((0.3, 2), {}), ((0.999, 16), {})],
    "speculative_speedup": [((0.7, 5, 0.1), {}), ((0.0, 4, 0.1), {}), ((0.85, 1, 1.0), {})],
    "rollback_blocks": [(([5], 16, 1), {}), (([7, 3, 2, 0], 1, 2), {}), (([10, 11, 12], 8, 16), {})],
})
