"""Submissions a student could plausibly write, per exercise: `wrong` ones must lose points, `right` ones
(correct, but written differently from the solution) must keep them. Each is the whole exercise cell.

A Triton exercise's variants replace only the kernel's loop body (between the solution markers), so they
stay short; `cell_source()` splices them into the solution's cell.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]

HISTOGRAM_QUANTILE = """\
import math
def histogram_quantile(q, buckets):
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    if len(buckets) < 2 or buckets[-1][1] == 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for i, (le, count) in enumerate(buckets):
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if i == 0 and le <= 0:
                return le
            if count == prev_count:
                return math.nan
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
"""
HISTOGRAM_QUANTILE_BISECT = """\
import bisect, math
def histogram_quantile(q, buckets):
    if not 0 <= q <= 1:
        return math.copysign(math.inf, q)
    les = [b[0] for b in buckets]
    counts = [b[1] for b in buckets]
    if len(buckets) < 2 or counts[-1] == 0:
        return math.nan
    rank = q * counts[-1]
    b = bisect.bisect_left(counts[:-1], rank)   # first finite bucket whose count reaches the rank
    if b == len(buckets) - 1:
        return les[-2]
    if b == 0 and les[0] <= 0:
        return les[0]
    start, n = (les[b - 1], counts[b] - counts[b - 1]) if b else (0.0, counts[0])
    r = rank - (counts[b - 1] if b else 0.0)
    return start + (les[b] - start) * (r / n) if n else math.nan
"""


VARIANTS: dict[str, dict[str, list[str]]] = {
    # ---- Lab 00 -------------------------------------------------------------------------------
    "lab00/matmul_arithmetic_intensity": {
        "wrong": ["def matmul_arithmetic_intensity(m, n, k, bytes_per_elem=2):\n"
                  "    return 2 * m * n * k / ((m * k + k * n) * bytes_per_elem)  # forgot writing C\n"],
        "right": ["from fractions import Fraction\n"
                  "def matmul_arithmetic_intensity(m, n, k, bytes_per_elem=2):\n"
                  "    elems = m * k + k * n + m * n\n"
                  "    return float(Fraction(2 * m * n * k) / (Fraction(elems) * Fraction(bytes_per_elem)))\n"],
    },
    "lab00/roofline_time": {
        "wrong": ["def roofline_time(flops, bytes_moved, peak_flops, bandwidth):\n"
                  "    return flops / peak_flops + bytes_moved / bandwidth  # no overlap\n"],
        "right": ["def roofline_time(flops, bytes_moved, peak_flops, bandwidth):\n"
                  "    return max(flops / peak_flops, bytes_moved / bandwidth)\n"],
    },
    "lab00/compute_bound_tokens": {
        "wrong": ["def compute_bound_tokens(weight_bytes, flops_per_token, peak_flops, bandwidth):\n"
                  "    return peak_flops / bandwidth  # the ridge point is in FLOP/byte, not in tokens\n",
                  "def compute_bound_tokens(weight_bytes, flops_per_token, peak_flops, bandwidth):\n"
                  "    return flops_per_token / weight_bytes * peak_flops / bandwidth  # upside down\n"],
        "right": ["def compute_bound_tokens(weight_bytes, flops_per_token, peak_flops, bandwidth):\n"
                  "    read_weights_s = weight_bytes / bandwidth\n"
                  "    one_token_math_s = flops_per_token / peak_flops\n"
                  "    return read_weights_s / one_token_math_s\n"],
    },
    "lab00/kv_bytes_per_token": {
        "wrong": ["def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_elem=2):\n"
                  "    return int(num_layers * num_kv_heads * head_dim * bytes_per_elem)  # K only\n"],
        "right": ["def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_elem=2):\n"
                  "    k = v = num_kv_heads * head_dim\n"
                  "    return int((k + v) * bytes_per_elem * num_layers)\n"],
    },
    "lab00/decode_tokens_per_s_bound": {
        "wrong": ["def decode_tokens_per_s_bound(weight_bytes, bandwidth, batch=1, context_len=0, kv_bytes_per_token=0):\n"
                  "    return bandwidth / (weight_bytes + batch * context_len * kv_bytes_per_token)  # steps/s, not tokens/s\n",
                  "def decode_tokens_per_s_bound(weight_bytes, bandwidth, batch=1, context_len=0, kv_bytes_per_token=0):\n"
                  "    # every sequence reads the weights itself\n"
                  "    return batch * bandwidth / (batch * weight_bytes + batch * context_len * kv_bytes_per_token)\n"],
        "right": ["def decode_tokens_per_s_bound(weight_bytes, bandwidth, batch=1, context_len=0, kv_bytes_per_token=0):\n"
                  "    seconds_per_step = (weight_bytes + batch * context_len * kv_bytes_per_token) / bandwidth\n"
                  "    return batch * (1.0 / seconds_per_step)\n"],
    },
    "lab00/precision_speedup": {
        "wrong": ["def precision_speedup(new_tokens, num_params, bytes_from, bytes_to, peak_from, peak_to, bandwidth):\n"
                  "    return peak_to / peak_from  # 'bf16 is 10x faster', whatever the forward\n",
                  "def precision_speedup(new_tokens, num_params, bytes_from, bytes_to, peak_from, peak_to, bandwidth):\n"
                  "    flops = 2 * num_params * new_tokens  # math and memory do not overlap\n"
                  "    return (flops / peak_from + num_params * bytes_from / bandwidth) / "
                  "(flops / peak_to + num_params * bytes_to / bandwidth)\n",
                  "def precision_speedup(new_tokens, num_params, bytes_from, bytes_to, peak_from, peak_to, bandwidth):\n"
                  "    return bytes_from / bytes_to  # half the bytes, twice as fast, even for a prefill\n"],
        "right": ["def precision_speedup(new_tokens, num_params, bytes_from, bytes_to, peak_from, peak_to, bandwidth):\n"
                  "    def forward_s(nbytes, peak):\n"
                  "        read_s = num_params * nbytes / bandwidth\n"
                  "        n_star = read_s / (2 * num_params / peak)  # tokens whose math takes as long as the read\n"
                  "        return read_s if new_tokens <= n_star else 2 * num_params * new_tokens / peak\n"
                  "    return forward_s(bytes_from, peak_from) / forward_s(bytes_to, peak_to)\n"],
    },
    # ---- Lab 01 -------------------------------------------------------------------------------
    "lab01/static_slot_grid": {
        "wrong": ["def static_slot_grid(output_lens, num_slots):\n"
                  "    span = max(output_lens)  # every batch padded to the longest request of all\n"
                  "    rows = [[] for _ in range(num_slots)]\n"
                  "    for start in range(0, len(output_lens), num_slots):\n"
                  "        lens = output_lens[start:start + num_slots]\n"
                  "        for s in range(num_slots):\n"
                  "            mine = lens[s] if s < len(lens) else 0\n"
                  "            rows[s] += [start + s] * mine + [-1] * (span - mine)\n"
                  "    return rows\n"],
        "right": ["import numpy as np\n"
                  "def static_slot_grid(output_lens, num_slots):\n"
                  "    batches = [output_lens[i:i + num_slots] for i in range(0, len(output_lens), num_slots)]\n"
                  "    grid = np.full((num_slots, sum(max(b) for b in batches)), -1)\n"
                  "    t = 0\n"
                  "    for b, lens in enumerate(batches):\n"
                  "        for s, n in enumerate(lens):\n"
                  "            grid[s, t:t + n] = b * num_slots + s\n"
                  "        t += max(lens)\n"
                  "    return grid\n"],
    },
    "lab01/continuous_slot_grid": {
        "wrong": ["def continuous_slot_grid(output_lens, num_slots):\n"
                  "    # a freed slot is refilled only one iteration later\n"
                  "    queue = list(range(len(output_lens)))\n"
                  "    owner, left, rows = [-1] * num_slots, [0] * num_slots, [[] for _ in range(num_slots)]\n"
                  "    freed = set()\n"
                  "    while queue or any(o >= 0 for o in owner):\n"
                  "        for s in range(num_slots):\n"
                  "            if owner[s] < 0 and queue and s not in freed:\n"
                  "                owner[s] = queue.pop(0)\n"
                  "                left[s] = output_lens[owner[s]]\n"
                  "        freed = set()\n"
                  "        for s in range(num_slots):\n"
                  "            rows[s].append(owner[s])\n"
                  "            if owner[s] >= 0:\n"
                  "                left[s] -= 1\n"
                  "                if left[s] == 0:\n"
                  "                    owner[s] = -1\n"
                  "                    freed.add(s)\n"
                  "    return rows\n"],
        "right": ["import heapq\n"
                  "def continuous_slot_grid(output_lens, num_slots):\n"
                  "    free_at = [(0, s) for s in range(num_slots)]  # (iteration the slot frees up, slot)\n"
                  "    spans = []\n"
                  "    for rid, n in enumerate(output_lens):\n"
                  "        t, s = heapq.heappop(free_at)\n"
                  "        spans.append((s, t, n, rid))\n"
                  "        heapq.heappush(free_at, (t + n, s))\n"
                  "    width = max([t + n for _, t, n, _ in spans], default=0)\n"
                  "    rows = [[-1] * width for _ in range(num_slots)]\n"
                  "    for s, t, n, rid in spans:\n"
                  "        rows[s][t:t + n] = [rid] * n\n"
                  "    return rows\n"],
    },
    "lab01/retire_and_admit": {
        "wrong": ["def retire_and_admit(running, waiting, free_blocks, block_size, max_num_seqs, max_num_batched_tokens):\n"
                  "    retired = [s['id'] for s in running if s['eos'] or s['output_len'] >= s['max_tokens']]\n"
                  "    free = free_blocks + sum(s['blocks'] for s in running if s['id'] in retired)\n"
                  "    counted, batch = free, [s['id'] for s in running if s['id'] not in retired]\n"
                  "    budget, admitted = max_num_batched_tokens, []  # forgot that decodes take the budget first\n"
                  "    for r in waiting:\n"
                  "        need = -(-r['prompt_len'] // block_size)\n"
                  "        if len(batch) >= max_num_seqs or r['prompt_len'] > budget or need > free:\n"
                  "            break\n"
                  "        admitted.append(r['id']); batch.append(r['id'])\n"
                  "        budget -= r['prompt_len']; free -= need\n"
                  "    used = len(batch) - len(admitted) + sum(r['prompt_len'] for r in waiting if r['id'] in admitted)\n"
                  "    return {'retired': retired, 'free_blocks': counted, 'admitted': admitted, 'running': batch,\n"
                  "            'num_batched_tokens': used, 'free_blocks_left': free}\n"],
        "right": ["import math\n"
                  "def retire_and_admit(running, waiting, free_blocks, block_size, max_num_seqs, max_num_batched_tokens):\n"
                  "    done = lambda s: s['eos'] or s['output_len'] >= s['max_tokens']\n"
                  "    free_blocks += sum(s['blocks'] for s in running if done(s))\n"
                  "    out = {'retired': [s['id'] for s in running if done(s)], 'free_blocks': free_blocks}\n"
                  "    ids = [s['id'] for s in running if not done(s)]\n"
                  "    tokens = len(ids)\n"
                  "    admitted = []\n"
                  "    i = 0\n"
                  "    while i < len(waiting) and len(ids) < max_num_seqs:\n"
                  "        r = waiting[i]\n"
                  "        need = math.ceil(r['prompt_len'] / block_size)\n"
                  "        if tokens + r['prompt_len'] > max_num_batched_tokens or need > free_blocks:\n"
                  "            break\n"
                  "        tokens += r['prompt_len']; free_blocks -= need\n"
                  "        admitted.append(r['id']); ids.append(r['id']); i += 1\n"
                  "    out.update(admitted=admitted, running=ids, num_batched_tokens=tokens, free_blocks_left=free_blocks)\n"
                  "    return out\n"],
    },
    # ---- Lab 02 -------------------------------------------------------------------------------
    "lab02/plan_token_budget": {
        "wrong": ["def plan_token_budget(decodes, prefills, max_num_batched_tokens, max_num_seqs=256, enable_chunked_prefill=True):\n"
                  "    left, plan = max_num_batched_tokens, []\n"
                  "    for d in decodes:\n"
                  "        if left == 0 or len(plan) == max_num_seqs:\n"
                  "            return plan\n"
                  "        plan.append((d, 1)); left -= 1\n"
                  "    for rid, n in prefills:\n"
                  "        if len(plan) == max_num_seqs or left == 0:\n"
                  "            break\n"
                  "        take = n if n <= left else (left if enable_chunked_prefill else 0)\n"
                  "        if take == 0:\n"
                  "            continue  # a later, smaller prompt may jump the queue\n"
                  "        plan.append((rid, take)); left -= take\n"
                  "    return plan\n"],
        "right": ["def plan_token_budget(decodes, prefills, max_num_batched_tokens, max_num_seqs=256, enable_chunked_prefill=True):\n"
                  "    plan = [(d, 1) for d in decodes][:min(max_num_seqs, max_num_batched_tokens)]\n"
                  "    used = len(plan)\n"
                  "    if len(plan) < len(decodes):\n"
                  "        return plan\n"
                  "    for rid, n in prefills:\n"
                  "        room = max_num_batched_tokens - used\n"
                  "        take = min(n, room) if enable_chunked_prefill else (n if n <= room else 0)\n"
                  "        if take <= 0 or len(plan) >= max_num_seqs:\n"
                  "            break\n"
                  "        plan.append((rid, take))\n"
                  "        used += take\n"
                  "    return plan\n"],
    },
    "lab02/choose_victim": {
        "wrong": ["def choose_victim(running, policy, now=0.0, aging=0.0):\n"
                  "    if not running:\n"
                  "        return None\n"
                  "    key = {'fcfs': lambda p: (running[p]['arrival_time'], p),\n"
                  "           'priority': lambda p: (running[p]['priority'], running[p]['arrival_time'], p),\n"
                  "           'sjf': lambda p: (running[p]['predicted_len'], running[p]['arrival_time'], p)}[policy]\n"
                  "    return running[min(range(len(running)), key=key)]['request_id']  # preempts the first, not the last\n"],
        "right": ["def choose_victim(running, policy, now=0.0, aging=0.0):\n"
                  "    def key(item):\n"
                  "        pos, r = item\n"
                  "        base = {'fcfs': (), 'priority': (r['priority'],),\n"
                  "                'sjf': (r['predicted_len'] - aging * max(0.0, now - r['arrival_time']),)}[policy]\n"
                  "        return base + (r['arrival_time'], pos)\n"
                  "    ranked = sorted(enumerate(running), key=key)\n"
                  "    return ranked[-1][1]['request_id'] if ranked else None\n"],
    },
    "lab02/sjf_order": {
        "wrong": ["def sjf_order(queue, now=0.0, aging=0.0):\n"
                  "    order = sorted(range(len(queue)), key=lambda p: (queue[p]['predicted_len'], queue[p]['arrival_time'], p))\n"
                  "    return [queue[p]['request_id'] for p in order]  # textbook SJF: no aging\n",
                  "def sjf_order(queue, now=0.0, aging=0.0):\n"
                  "    key = lambda p: (queue[p]['predicted_len'] - aging * (now - queue[p]['arrival_time']),\n"
                  "                     queue[p]['arrival_time'], p)  # forgot max(0, .): future arrivals get a penalty\n"
                  "    return [queue[p]['request_id'] for p in sorted(range(len(queue)), key=key)]\n"],
        "right": ["def sjf_order(queue, now=0.0, aging=0.0):\n"
                  "    def effective(item):\n"
                  "        pos, r = item\n"
                  "        waited = now - r['arrival_time'] if now > r['arrival_time'] else 0.0\n"
                  "        return (r['predicted_len'] - waited * aging, r['arrival_time'], pos)\n"
                  "    return [r['request_id'] for _, r in sorted(enumerate(queue), key=effective)]\n"],
    },
    "lab02/histogram_quantile": {
        "wrong": [HISTOGRAM_QUANTILE.replace("return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)",
                                             "return le  # the bucket's upper bound, no interpolation"),
                  HISTOGRAM_QUANTILE.replace("return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)",
                                             "return (le - prev_le) * (rank - prev_count) / (count - prev_count)  # from 0"),
                  HISTOGRAM_QUANTILE.replace("            if math.isinf(le):\n                return prev_le\n", ""),
                  HISTOGRAM_QUANTILE.replace("rank = q * buckets[-1][1]", "rank = q * sum(c for _, c in buckets)  # not cumulative")],
        "right": [HISTOGRAM_QUANTILE_BISECT, HISTOGRAM_QUANTILE],
    },
    # ---- Lab 03 -------------------------------------------------------------------------------
    "lab03/online_softmax_update": {
        "wrong": ["import torch\n"
                  "def online_softmax_update(m, l, acc, scores, v_tile):\n"
                  "    new_m = torch.maximum(m, scores.max(-1).values)\n"
                  "    safe = torch.where(torch.isneginf(new_m), torch.zeros_like(new_m), new_m)\n"
                  "    p = torch.exp(scores - safe.unsqueeze(-1))\n"
                  "    return new_m, l + p.sum(-1), acc + p @ v_tile  # forgot to rescale the old state\n"],
        "right": ["import torch\n"
                  "def online_softmax_update(m, l, acc, scores, v_tile):\n"
                  "    m_new = torch.maximum(m, scores.amax(dim=-1))\n"
                  "    finite = torch.isfinite(m_new)\n"
                  "    alpha = torch.where(finite, torch.exp(m - torch.where(finite, m_new, 0.0)), torch.zeros_like(m))\n"
                  "    p = torch.where(finite.unsqueeze(-1), torch.exp(scores - torch.where(finite, m_new, 0.0).unsqueeze(-1)), 0.0)\n"
                  "    l = alpha * l + p.sum(dim=-1)\n"
                  "    acc = alpha.unsqueeze(-1) * acc + torch.einsum('...mn,...nd->...md', p, v_tile)\n"
                  "    return m_new, l, acc\n"],
    },
    "lab03/merge_attention_states": {
        "wrong": ["import torch\n"
                  "def merge_attention_states(o1, lse1, o2, lse2):\n"
                  "    return (o1 + o2) / 2, torch.maximum(lse1, lse2)  # equal weights\n"],
        "right": ["import torch\n"
                  "def merge_attention_states(o1, lse1, o2, lse2):\n"
                  "    lse = torch.logaddexp(lse1, lse2)\n"
                  "    both_empty = torch.isneginf(lse)\n"
                  "    base = torch.where(both_empty, torch.zeros_like(lse), lse)\n"
                  "    w1 = torch.exp(lse1 - base).unsqueeze(-1)\n"
                  "    w2 = torch.exp(lse2 - base).unsqueeze(-1)\n"
                  "    o = torch.where(both_empty.unsqueeze(-1), torch.zeros_like(o1), w1 * o1 + w2 * o2)\n"
                  "    return o, lse\n"],
    },
    "lab03/gather_paged_kv": {
        "wrong": ["import torch\n"
                  "def gather_paged_kv(cache, block_table, length):\n"
                  "    blocks = cache[block_table.long()]  # every table entry, padding included\n"
                  "    return blocks.reshape(-1, *cache.shape[2:])[:length]\n"],
        "right": ["import torch\n"
                  "def gather_paged_kv(cache, block_table, length):\n"
                  "    bs = cache.shape[1]\n"
                  "    used = -(-length // bs)\n"
                  "    parts = [cache[int(block_table[i])] for i in range(used)]\n"
                  "    if not parts:\n"
                  "        return cache.new_empty(0, *cache.shape[2:])\n"
                  "    return torch.cat(parts, dim=0)[:length]\n"],
    },
    "lab03/build_cu_seqlens": {
        "wrong": ["import torch\n"
                  "def build_cu_seqlens(seq_lens, device=None):\n"
                  "    lens = torch.as_tensor(list(seq_lens), dtype=torch.int64)\n"
                  "    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])  # int64, not int32\n"],
        "right": ["import torch\n"
                  "def build_cu_seqlens(seq_lens, device=None):\n"
                  "    lens = torch.as_tensor([int(n) for n in seq_lens], dtype=torch.int32)\n"
                  "    out = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)\n"
                  "    out[1:] = torch.cumsum(lens, 0)\n"
                  "    return out\n"],
    },
    "lab03/flash_attention": {   # loop bodies of _attn_fwd_tile_kernel
        "wrong": ["""\
        key_pos = start_n + tl.arange(0, BLOCK_N)
        key_ok = key_pos < seqlen_k
        k_tile = tl.load(k_base + key_pos[:, None] * stride_kn + dims[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k_tile), input_precision=PRECISION) * sm_scale
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (key_pos[None, :] <= rows[:, None] + shift)
        s = tl.where(visible, s, float("-inf"))
        m_next = tl.maximum(m_i, tl.max(s, axis=1))
        base = tl.where(m_next == float("-inf"), 0.0, m_next)
        p = tl.exp(s - base[:, None])
        v_tile = tl.load(v_base + key_pos[:, None] * stride_vn + dims[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc + tl.dot(p.to(v_tile.dtype), v_tile, input_precision=PRECISION)  # old tiles never rescaled
        l_i = l_i + tl.sum(p, axis=1)
        m_i = m_next
"""],
        "right": ["""\
        # base-2 exponentials, as the library kernel does: exp(x) = exp2(x * log2(e))
        cols = start_n + tl.arange(0, BLOCK_N)
        in_range = cols < seqlen_k
        kt = tl.load(k_base + cols[:, None] * stride_kn + dims[None, :], mask=in_range[:, None], other=0.0)
        vt = tl.load(v_base + cols[:, None] * stride_vn + dims[None, :], mask=in_range[:, None], other=0.0)
        LOG2E: tl.constexpr = 1.4426950408889634
        scores = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * (sm_scale * LOG2E)
        ok = in_range[None, :] & (rows[:, None] >= 0)
        if CAUSAL:
            ok = ok & (cols[None, :] - shift <= rows[:, None])
        scores = tl.where(ok, scores, float("-inf"))
        m2 = m_i * LOG2E
        m2_new = tl.maximum(m2, tl.max(scores, axis=1))
        anchor = tl.where(m2_new == float("-inf"), 0.0, m2_new)
        alpha = tl.exp2(m2 - anchor)
        probs = tl.exp2(scores - anchor[:, None])
        l_i = alpha * l_i + tl.sum(probs, axis=1)
        acc = alpha[:, None] * acc + tl.dot(probs.to(vt.dtype), vt, input_precision=PRECISION)
        m_i = m2_new / LOG2E
"""],
    },
}

for _lab in range(4, 11):   # one file per lab from Lab 04 on: tests/variants_labNN.py
    VARIANTS.update(importlib.import_module(f"variants_lab{_lab:02d}").VARIANTS)



def solution_notebook(lab: str) -> Path:
    return next((ROOT / "solutions").glob(f"{lab}_*.ipynb"))


def cell_source(key: str, variant: str) -> str:
    """The whole exercise cell for a variant (kernel loop bodies are spliced into the solution's cell)."""
    from llmso_lab.grading import get_exercise
    from llmso_lab.grading.notebook import exercise_cell_source

    ex = get_exercise(key)
    if not ex.triton_kernel:
        return variant
    nb = nbformat.read(str(solution_notebook(ex.lab)), as_version=4)
    src = exercise_cell_source(nb, ex.graded_name)
    return re.sub(r"[ \t]*### BEGIN SOLUTION\n.*?[ \t]*### END SOLUTION\n", lambda _: variant, src, flags=re.S)


def notebook_with(lab: str, replacements: dict[str, str], path: Path) -> Path:
    """The lab's solution notebook with the cells defining each replaced exercise swapped out."""
    from llmso_lab.grading import get_exercise
    from llmso_lab.grading.notebook import _defined_names, _code

    nb = nbformat.read(str(solution_notebook(lab)), as_version=4)
    for key, source in replacements.items():
        name = get_exercise(key).graded_name
        cells = [c for c in nb.cells if c.cell_type == "code" and name in _defined_names(_code(c))]
        assert len(cells) == 1, f"{key}: {len(cells)} cells define {name}"
        cells[0].source, cells[0].outputs = source, []
    nbformat.write(nb, str(path))
    return path


def in_process_verdicts(ex, source: str) -> list:
    """What check() would say on every case (hidden ones too), with the cell run in a fresh namespace:
    None where a case passes, else why not (the grader's own `verdict`; test_lab_variants checks they agree)."""
    import linecache
    import os

    from llmso_lab.grading.check import outcome_in_process
    from llmso_lab.grading.child import PRELUDE
    from llmso_lab.grading.grader import expected_values
    from llmso_lab.grading.protocol import verdict

    ns: dict = {"__name__": "__main__"}
    exec(compile(PRELUDE, "<prelude>", "exec"), ns)
    path = f"/tmp/llmso-variant-{os.getpid()}-{ex.name}.py"   # per process: tests may run in parallel workers
    with open(path, "w") as f:
        f.write(source)
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    exec(compile(source, path, "exec"), ns)
    expected = expected_values(ex)
    return [verdict(ex, c, outcome_in_process(ex, ns[ex.graded_name], i), expected[i]) for i, c in enumerate(ex.cases)]
