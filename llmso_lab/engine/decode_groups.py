"""Decode rows in groups of similar context length: the torch attention backend's fast path.

The reference decode (`TorchAttentionBackend._decode_group`) gathers every row's cached blocks, padded to
the longest context among the rows, and runs one SDPA. Next to a long row, a short row copies the long
row's worth of padding. Splitting the rows into groups of similar length gathers less, but every group costs
one more gather + SDPA call per layer. `length_groups` picks the cheapest split; `plan_decode_groups` turns it
into gather indices once per step (the same for every layer). Each row still attends to exactly its own keys,
so the tokens do not change (tests: `test_engine_decode_groups.py`, and against HF in `test_engine_exactness.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# One more group costs two gathers and an SDPA call per layer (~80 us on a 2-core CPU), about what
# gathering this many more blocks of padding costs (SmolLM2: 16 keys, 1.5 KB of K and V each per layer).
# On bench batching's workload 8 and 24 gave the same throughput within noise, 3-7% above never
# splitting. 0 = always split.
GROUP_COST_BLOCKS = 24


@dataclass(slots=True)
class DecodeGroup:
    rows: Tensor       # [b] int64: the group's rows among the step's decodes
    blocks: Tensor     # [b * nb] int64: their first nb block ids, row after row (null-block padded)
    S: int             # nb * block_size: keys gathered per row
    ctx: list[int]     # [b] context length of each row


def length_groups(lengths: list[int], group_cost: int) -> list[list[int]]:
    """Split rows into groups of similar length: padding every row to its group's longest costs
    rows * longest, and each group adds `group_cost`. Sorting by length and choosing the cuts by dynamic
    programming minimises the total. Returns row indices, shortest group first; one group when padding is cheap."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):           # best[j]: cheapest grouping of the j shortest rows
        for i in range(j):                       # ... whose last group is rows i..j-1 of the sorted order
            cost = best[i] + (j - i) * lengths[order[j - 1]] + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def plan_decode_groups(block_tables: Tensor, context_lens: list[int], block_size: int,
                       group_cost: int | None = GROUP_COST_BLOCKS) -> list[DecodeGroup]:
    """Gather plan of B decode rows: block_tables [B, max_blocks] (null-block padded), context_lens [B].
    group_cost=None: one group of all rows in batch order, padded to the longest (the reference)."""
    bs, B = block_size, len(context_lens)
    split = length_groups([-(-c // bs) for c in context_lens], group_cost) if group_cost is not None else []
    groups = []
    for rows in split if len(split) > 1 else [list(range(B))]:   # one group: rows stay in batch order
        nb = -(-max(context_lens[r] for r in rows) // bs)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=block_tables.device)
        blocks = block_tables.index_select(0, rows_t)[:, :nb].reshape(-1).long()
        groups.append(DecodeGroup(rows_t, blocks, nb * bs, [context_lens[r] for r in rows]))
    return groups
