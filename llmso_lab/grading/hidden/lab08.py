"""Hidden checks for Lab 08 (instructor only; not in the student bundle): other sizes, links and seeds."""
import torch

from llmso_lab.grading.registry import hidden
from llmso_lab.grading.specs.lab08 import counting_weight, randn, ring_inputs, routed
from llmso_lab.hardware import LINKS

hidden("08", {
    "shard_linear": [((counting_weight(12, 4), 1, 3, "column"), {}), ((counting_weight(5, 10), 4, 5, "row"), {}),
                     ((randn(16, 8, seed=101), 5, 8, "column"), {}), ((randn(8, 8, seed=102), 0, 4, "row"), {}),
                     ((randn(6, 9, seed=103).to(torch.bfloat16), 2, 3, "row"), {})],
    "tp_mlp_forward": [((2,), {"num_tokens": 3, "hidden": 8, "intermediate": 16, "seed": 11}),
                       ((3,), {"num_tokens": 1, "hidden": 20, "intermediate": 12, "seed": 12})],
    "pipeline_stage": [((2, 2), {"seed": 13}), ((3, 6), {"rows": 1, "hidden": 4, "seed": 14})],
    "tp_allreduces_per_token": [((61,), {}), ((126,), {}), ((2,), {})],
    "allreduce_time": [((0, 4, LINKS["NVLink3"]), {}), ((8192, 2, LINKS["PCIe4"]), {}),
                       ((3.5e9, 64, LINKS["IB-NDR"]), {}), ((1 << 20, 3, LINKS["25GbE"]), {}),
                       ((4096, 1, LINKS["NVLink4"]), {})],
    "bubble_fraction": [((4, 32), {}), ((16, 3), {}), ((3, 3), {}), ((1, 1), {})],
    "dispatch_indices": [((routed(32, 2, 8, seed=104, skew=2.0), 8, 8), {}),
                         ((routed(12, 3, 6, seed=105), 6, None), {}),
                         ((routed(20, 1, 4, seed=106, skew=1.0), 4, 5), {}),
                         ((torch.tensor([[3, 1], [1, 3], [3, 0], [0, 1], [3, 2]]), 4, 2), {}),
                         ((routed(9, 4, 4, seed=107), 4, 7), {})],
    "ring_attention_step": [(ring_inputs(1, 4, range(3, 6), range(0, 3), seed=108), {}),
                            (ring_inputs(3, 16, range(8, 13), range(8, 13), seed=109, before=range(0, 8)), {}),
                            (ring_inputs(2, 8, [0, 1, 2, 21, 22, 23], [6, 7, 8, 15, 16, 17], seed=110), {}),
                            (ring_inputs(2, 8, [3, 4, 5, 18, 19, 20], [6, 7, 8, 15, 16, 17], seed=111,
                                         before=[0, 1, 2, 21, 22, 23]), {}),
                            (ring_inputs(2, 8, range(0, 4), range(4, 9), seed=112, before=range(0, 4)), {}),
                            (ring_inputs(4, 32, range(20, 24), range(16, 24), seed=113, before=range(0, 16),
                                         scale=1.0, q_scale=4.0), {})],
})
