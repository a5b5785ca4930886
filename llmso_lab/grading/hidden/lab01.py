"""Hidden checks for Lab 01 (instructor only; not in the student bundle): edge cases of each exercise."""
from llmso_lab.grading.registry import hidden
from llmso_lab.grading.specs.lab01 import req, seq

hidden("01", {
    "static_slot_grid": [
        (([4, 1, 3], 1), {}),                       # one slot: requests run one after another
        (([3, 5], 4), {}),                          # fewer requests than slots: the rest stay empty
        (([2, 2, 2, 2, 2, 2], 3), {}),              # equal lengths: no hole at all
        (([1, 9, 1, 1, 8, 2, 2, 7, 1, 1], 3), {}),  # four batches, long and short mixed
    ],
    "continuous_slot_grid": [
        (([], 3), {}),                              # nothing to run: 3 empty rows
        (([3, 1, 2], 1), {}),                       # one slot
        (([2, 1], 4), {}),                          # more slots than requests
        (([1, 1, 1, 1, 1, 1, 1], 3), {}),           # every slot frees every iteration
        (([9, 1, 1, 1, 1, 1, 1, 1], 2), {}),        # one long request; short ones stream through the other slot
        (([2, 5, 2, 2, 1, 3, 3], 3), {}),           # several slots free at once: lowest slot first
    ],
    "retire_and_admit": [
        (([seq(0, 1, 4, 1), seq(1, 2, 4, 2)], [], 3, 16, 4, 256), {}),                      # empty queue
        (([], [req(0, 100), req(1, 5)], 6, 16, 4, 256), {}),                                 # head needs 7 blocks, 6 free
        (([seq(i, 1, 9, 1) for i in range(4)], [req(9, 3)], 10, 16, 4, 256), {}),            # max_num_seqs reached
        (([seq(0, 3, 3, 2)], [req(1, 32), req(2, 1)], 0, 16, 4, 33), {}),                    # exact blocks, exact budget
        (([seq(0, 5, 5, 3), seq(1, 1, 8, 2, eos=True)], [req(2, 16), req(3, 17)], 0, 16, 2, 64), {}),  # all retire
        (([seq("x", 0, 3, 1), seq("y", 2, 3, 1)], [req("z", 4), req("w", 4), req("v", 4)], 2, 4, 3, 16), {}),  # seq cap
        (([seq(0, 4, 5, 1, eos=False)], [req(1, 1), req(2, 1), req(3, 1)], 1, 16, 8, 2), {}),  # budget of 1 after decode
    ],
})
