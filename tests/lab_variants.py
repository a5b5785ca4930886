"""Submissions a student could plausibly write, per exercise: `wrong` ones must lose points, `right` ones
(correct, but written differently from the solution) must keep them. Each is the whole exercise cell.

A Triton exercise's variants replace only the kernel's loop body (between the solution markers), so they
stay short; `cell_source()` splices them into the solution's cell.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]

# Lab 04 pieces shared by several variants: a whole BlockAllocator (correct; the wrong ones edit one line of it), the
# given driver of the prefix-cache exercise, and a correct sha256 chain and longest-prefix walk.
ALLOCATOR = """\
class BlockAllocator:
    def __init__(self, num_blocks, block_size):
        self.bs, self.pool = block_size, list(range(num_blocks))  # takes from the end: other ids than the solution
        self.refs, self.tables, self.lens = {}, {}, {}

    def _new(self):
        b = self.pool.pop()
        self.refs[b] = 1
        return b

    def allocate(self, seq_id, num_tokens):
        if -(-num_tokens // self.bs) > len(self.pool):
            raise MemoryError("out of KV blocks")
        self.tables[seq_id] = [self._new() for _ in range(-(-num_tokens // self.bs))]
        self.lens[seq_id] = num_tokens

    def fork(self, parent_id, child_id):
        self.refs.update({b: self.refs[b] + 1 for b in self.tables[parent_id]})
        self.tables[child_id] = list(self.tables[parent_id])
        self.lens[child_id] = self.lens[parent_id]

    def append(self, seq_id, num_tokens=1):
        t, n = self.tables[seq_id], self.lens[seq_id]
        shared = n % self.bs and self.refs[t[-1]] > 1
        need = -(-(n + num_tokens) // self.bs) - len(t) + (1 if shared else 0)
        if need > len(self.pool):
            raise MemoryError("out of KV blocks")
        copied = 0
        if shared:
            self.refs[t[-1]] -= 1
            t[-1] = self._new()
            copied = 1
        while len(t) * self.bs < n + num_tokens:
            t.append(self._new())
        self.lens[seq_id] = n + num_tokens
        return copied

    def free(self, seq_id):
        for b in self.tables.pop(seq_id):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.pool.append(b)
        del self.lens[seq_id]

    def num_free_blocks(self):
        return len(self.pool)

    def ref_counts(self, seq_id):
        return [self.refs[b] for b in self.tables[seq_id]]
"""
DRIVER = """\
def prefix_cache_hits(prompts, block_size):
    cache, keys, hits = set(), [], []
    for p in prompts:
        hits.append(cached_prefix_tokens(p, cache, block_size))
        keys.append(block_hash_chain(p, block_size))
        cache.update(keys[-1])
    return {"keys": keys, "hit_tokens": hits}
"""
CACHED_PREFIX = """\
def cached_prefix_tokens(token_ids, cached_keys, block_size):
    hits = 0
    for key in block_hash_chain(token_ids, block_size)[:(len(token_ids) - 1) // block_size]:
        if key not in cached_keys:
            break
        hits += 1
    return hits * block_size
"""
CHAIN_SHA256 = """\
import hashlib
def block_hash_chain(token_ids, block_size):
    keys, parent = [], b"root"
    for i in range(len(token_ids) // block_size):
        h = hashlib.sha256(parent + bytes(str(token_ids[i * block_size:(i + 1) * block_size]), "utf8"))
        parent = h.digest()
        keys.append(h.hexdigest())
    return keys
"""

# Lab 10: KIVI cells are built from one template; a wrong variant changes one decision (which axis the keys' grid
# spans, which tokens are quantized). `{keys_dim}`: -1 is per token (wrong), 0 per channel; `{span}`: the
# quantized token range.
KIVI_TEMPLATE = """\
def kivi_fake_quantize(k, v, bits, group_size, residual_length):
    def fake(x, dim):
        lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
        scale = (hi - lo) / (2 ** bits - 1)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return ((x - lo) / scale).round().clamp(0, 2 ** bits - 1) * scale + lo

    T = k.shape[0]
    n_q = {n_q}
    first = {first}
    k_hat, v_hat = k.float().clone(), v.float().clone()
    for s in range(first, first + n_q, group_size):
        k_hat[s:s + group_size] = fake(k[s:s + group_size].float(), dim={keys_dim})
    if n_q:
        v_hat[first:first + n_q] = fake(v[first:first + n_q].float(), dim=-1)
    return k_hat, v_hat
"""
KIVI_N_Q = "max(0, T - residual_length) // group_size * group_size"


def kivi(n_q: str = KIVI_N_Q, first: str = "0", keys_dim: str = "0") -> str:
    return KIVI_TEMPLATE.format(n_q=n_q, first=first, keys_dim=keys_dim)


KIVI_VECTORISED = """\
def kivi_fake_quantize(k, v, bits, group_size, residual_length):
    T, H, D = k.shape
    levels = 2 ** bits - 1
    n_q = (T - residual_length) // group_size * group_size if T > residual_length else 0
    out_k, out_v = k.double().clone(), v.double().clone()   # float64 inside, fp32 out

    def grid(x, dim):
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        step = ((hi - lo) / levels).masked_fill(hi == lo, 1.0)
        code = torch.clamp(torch.round((x - lo) / step), 0, levels)
        return lo + code * step

    g = out_k[:n_q].reshape(n_q // group_size, group_size, H, D)   # all key groups at once
    out_k[:n_q] = grid(g, 1).reshape(n_q, H, D)
    out_v[:n_q] = grid(out_v[:n_q], 2)
    return out_k.float(), out_v.float()
"""
KIVI_LOOPS = """\
def kivi_fake_quantize(k, v, bits, group_size, residual_length):
    T, H, D = k.shape
    top = (1 << bits) - 1
    quantized = 0
    while quantized + group_size <= T - residual_length:   # whole groups that have left the window
        quantized += group_size

    def rt(xs):   # one set of numbers: its read-back
        lo, hi = min(xs), max(xs)
        s = (hi - lo) / top if hi > lo else 1.0
        return [lo + min(max(round((x - lo) / s), 0), top) * s for x in xs]

    kh, vh = k.clone().float(), v.clone().float()
    for g in range(0, quantized, group_size):
        for h in range(H):
            for d in range(D):
                kh[g:g + group_size, h, d] = torch.tensor(rt(k[g:g + group_size, h, d].tolist()))
    for t in range(quantized):
        for h in range(H):
            vh[t, h] = torch.tensor(rt(v[t, h].tolist()))
    return kh, vh
"""
SNAPKV = """\
def snapkv_keep(q_obs, k, budget, window, kernel_size=7):
    H, W, D = q_obs.shape
    Hkv, T, _ = k.shape
    if budget >= T:
        return torch.arange(T).repeat(Hkv, 1)
    q = q_obs.view(Hkv, H // Hkv, W, D)
    logits = torch.einsum('gqwd,gtd->gqwt', q, k) / math.sqrt(D)
    future = torch.arange(T) > (T - W + torch.arange(W))[:, None]
    logits = logits.masked_fill(future, float('-inf'))
    votes = logits.softmax(dim=-1).mean(dim=(1, 2))                       # [Hkv, T]
    pooled = F.max_pool1d(votes[:, None], kernel_size, stride=1, padding=kernel_size // 2)[:, 0]
    best = pooled[:, : T - W].argsort(dim=-1, descending=True)[:, : budget - W]
    keep = torch.cat([best, torch.arange(T - W, T).repeat(Hkv, 1)], dim=1)
    return keep.sort(dim=1).values
"""
SNAPKV_LOOPS = """\
def snapkv_keep(q_obs, k, budget, window, kernel_size=7):
    H, W, D = q_obs.shape
    Hkv, T, _ = k.shape
    g = H // Hkv
    out = []
    for j in range(Hkv):
        if budget >= T:
            out.append(torch.arange(T))
            continue
        votes = torch.zeros(T, dtype=torch.float64)
        for h in range(j * g, (j + 1) * g):
            for i in range(W):
                pos = T - W + i                     # this query sees keys 0..pos
                s = (k[j, : pos + 1].double() @ q_obs[h, i].double()) / D ** 0.5
                p = torch.exp(s - s.max())
                votes[: pos + 1] += p / p.sum() / (g * W)
        r = kernel_size // 2
        pooled = [votes[max(0, t - r): t + r + 1].max().item() for t in range(T)]
        best = sorted(range(T - W), key=lambda t: -pooled[t])[: budget - W]
        out.append(torch.tensor(sorted(best) + list(range(T - W, T))))
    return torch.stack(out)
"""
PYRAMID = """\
def pyramid_budgets(num_layers, total_budget, beta=20):
    L = num_layers
    if L == 1:
        return [total_budget]
    k = total_budget / L
    top, bottom = k / beta, 2 * k - k / beta
    exact = [top + (bottom - top) * (L - 1 - l) / (L - 1) for l in range(L)]
    out = [int(x) for x in exact]
    by_remainder = sorted(range(L), key=lambda l: (-(exact[l] - out[l]), l))
    for l in by_remainder[: total_budget - sum(out)]:
        out[l] += 1
    return out
"""
PYRAMID_HEAP = """\
import heapq
def pyramid_budgets(num_layers, total_budget, beta=20):
    if num_layers == 1:
        return [total_budget]
    avg = total_budget / num_layers
    step = (2 * avg - 2 * avg / beta) / (num_layers - 1)
    exact = [2 * avg - avg / beta - l * step for l in range(num_layers)]
    base = [math.floor(x) for x in exact]
    heap = [(-(x - b), l) for l, (x, b) in enumerate(zip(exact, base))]   # largest remainder, then lowest layer
    heapq.heapify(heap)
    for _ in range(total_budget - sum(base)):
        base[heapq.heappop(heap)[1]] += 1
    return base
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
    # ---- Lab 04 -------------------------------------------------------------------------------
    "lab04/kv_waste": {
        "wrong": ["def kv_waste(lengths, scheme, *, moment='lifetime', max_model_len=None, max_tokens=None, block_size=None):\n"
                  "    ratios = []  # the mean of per-sequence waste, not the share of memory\n"
                  "    for p, o in lengths:\n"
                  "        held = [p + o] if moment == 'at_finish' else list(range(p, p + o))\n"
                  "        slots = [max_model_len if scheme == 'contiguous_max_len' else p + max_tokens\n"
                  "                 if scheme == 'contiguous_max_tokens' else -(-n // block_size) * block_size for n in held]\n"
                  "        ratios.append(1 - sum(held) / sum(slots))\n"
                  "    return sum(ratios) / len(ratios)\n",
                  "def kv_waste(lengths, scheme, *, moment='lifetime', max_model_len=None, max_tokens=None, block_size=None):\n"
                  "    stored = reserved = 0\n"
                  "    for p, o in lengths:\n"
                  "        held = [p + o] if moment == 'at_finish' else list(range(p + 1, p + o + 1))  # counts the last sampled token\n"
                  "        for n in held:\n"
                  "            stored += n\n"
                  "            reserved += {'contiguous_max_len': max_model_len, 'contiguous_max_tokens': p + (max_tokens or 0),\n"
                  "                         'paged': -(-n // (block_size or 1)) * (block_size or 1)}[scheme]\n"
                  "    return 1 - stored / reserved\n"],
        "right": ["def kv_waste(lengths, scheme, *, moment='lifetime', max_model_len=None, max_tokens=None, block_size=None):\n"
                  "    empty = total = 0\n"
                  "    for p, o in lengths:\n"
                  "        states = [p + o] if moment == 'at_finish' else [p + k for k in range(o)]\n"
                  "        for n in states:\n"
                  "            if scheme == 'paged':\n"
                  "                r = block_size * ((n + block_size - 1) // block_size)\n"
                  "            elif scheme == 'contiguous_max_tokens':\n"
                  "                r = p + max_tokens\n"
                  "            else:\n"
                  "                r = max_model_len\n"
                  "            empty += r - n\n"
                  "            total += r\n"
                  "    return empty / total\n"],
    },
    "lab04/BlockAllocator": {
        "wrong": [ALLOCATOR.replace("        self.refs.update({b: self.refs[b] + 1 for b in self.tables[parent_id]})\n"
                                    "        self.tables[child_id] = list(self.tables[parent_id])\n",
                                    "        self.tables[child_id] = [self._new() for _ in self.tables[parent_id]]  # copies: no sharing\n"),
                  ALLOCATOR.replace("        if shared:\n", "        if False:  # writes into the shared block\n"),
                  ALLOCATOR.replace("        for b in self.tables.pop(seq_id):\n"
                                    "            self.refs[b] -= 1\n"
                                    "            if self.refs[b] == 0:\n"
                                    "                self.pool.append(b)\n",
                                    "        for b in self.tables.pop(seq_id):\n"
                                    "            if self.refs[b] == 1:  # shared blocks are left alone: never decremented\n"
                                    "                self.refs[b] = 0\n"
                                    "                self.pool.append(b)\n")],
        "right": [ALLOCATOR],
    },
    "lab04/prefix_cache_hits": {
        "wrong": ["def block_hash_chain(token_ids, block_size):\n"
                  "    n = len(token_ids) // block_size  # a hash of the block's own tokens: no parent\n"
                  "    return [hash(tuple(token_ids[i * block_size:(i + 1) * block_size])) for i in range(n)]\n"
                  + CACHED_PREFIX + DRIVER,
                  "def block_hash_chain(token_ids, block_size):\n"
                  "    n = len(token_ids) // block_size  # position + own tokens: still not the whole prefix\n"
                  "    return [hash((i, tuple(token_ids[i * block_size:(i + 1) * block_size]))) for i in range(n)]\n"
                  + CACHED_PREFIX + DRIVER,
                  CHAIN_SHA256 +
                  "def cached_prefix_tokens(token_ids, cached_keys, block_size):\n"
                  "    hits = 0  # every full block counts, even when the whole prompt is cached\n"
                  "    for key in block_hash_chain(token_ids, block_size):\n"
                  "        if key not in cached_keys:\n"
                  "            break\n"
                  "        hits += block_size\n"
                  "    return hits\n" + DRIVER],
        "right": [CHAIN_SHA256 + CACHED_PREFIX + DRIVER,
                  "def block_hash_chain(token_ids, block_size):\n"
                  "    full = len(token_ids) - len(token_ids) % block_size  # the key: the whole prefix itself\n"
                  "    return [tuple(token_ids[:end]) for end in range(block_size, full + 1, block_size)]\n"
                  "def cached_prefix_tokens(token_ids, cached_keys, block_size):\n"
                  "    keys = block_hash_chain(token_ids, block_size)[:(len(token_ids) - 1) // block_size]\n"
                  "    n = next((i for i, k in enumerate(keys) if k not in cached_keys), len(keys))\n"
                  "    return n * block_size\n" + DRIVER],
    },
    "lab04/RadixTree": {
        "wrong": ["class RadixTree:\n"
                  "    def __init__(self):\n"
                  "        self.root = {}  # edge (tuple of tokens) -> child; an edge is never split\n"
                  "    def _walk(self, tokens):\n"
                  "        node, pos = self.root, 0\n"
                  "        while True:\n"
                  "            for edge, child in node.items():\n"
                  "                if tuple(tokens[pos:pos + len(edge)]) == edge:\n"
                  "                    node, pos = child, pos + len(edge)\n"
                  "                    break\n"
                  "            else:\n"
                  "                return node, pos\n"
                  "    def insert(self, tokens):\n"
                  "        node, pos = self._walk(tokens)\n"
                  "        if pos < len(tokens):\n"
                  "            node[tuple(tokens[pos:])] = {}\n"
                  "        return pos\n"
                  "    def match_prefix(self, tokens):\n"
                  "        return self._walk(tokens)[1]\n"
                  "    def num_nodes(self):\n"
                  "        count, stack = 0, [self.root]\n"
                  "        while stack:\n"
                  "            node = stack.pop()\n"
                  "            count += len(node)\n"
                  "            stack += list(node.values())\n"
                  "        return count\n",
                  "class RadixTree:\n"
                  "    BLOCK = 4  # block-granular, as a hash chain of 4-token blocks would be\n"
                  "    def __init__(self):\n"
                  "        self.trie = {}\n"
                  "    def _depth(self, tokens):\n"
                  "        node, n = self.trie, 0\n"
                  "        while n < len(tokens) and tokens[n] in node:\n"
                  "            node, n = node[tokens[n]], n + 1\n"
                  "        return n - n % self.BLOCK\n"
                  "    def insert(self, tokens):\n"
                  "        before = self._depth(tokens)\n"
                  "        node = self.trie\n"
                  "        for t in tokens:\n"
                  "            node = node.setdefault(t, {})\n"
                  "        node.setdefault('end', {})\n"
                  "        return before\n"
                  "    def match_prefix(self, tokens):\n"
                  "        return self._depth(tokens)\n"
                  "    def num_nodes(self):\n"
                  "        def count(node, top):\n"
                  "            kids = [k for k in node if k != 'end']\n"
                  "            here = 0 if top else int('end' in node or len(kids) != 1)\n"
                  "            return here + sum(count(node[k], False) for k in kids)\n"
                  "        return count(self.trie, True)\n"],
        "right": ["class RadixTree:\n"
                  "    '''One trie node per token; a radix node is a token where a list ends or the paths branch.'''\n"
                  "    def __init__(self):\n"
                  "        self.kids, self.ends = [{}], [False]  # node i: its children by token, does an inserted list end here\n"
                  "    def _walk(self, tokens):\n"
                  "        node, n = 0, 0\n"
                  "        while n < len(tokens) and tokens[n] in self.kids[node]:\n"
                  "            node, n = self.kids[node][tokens[n]], n + 1\n"
                  "        return node, n\n"
                  "    def insert(self, tokens):\n"
                  "        node, n = self._walk(tokens)\n"
                  "        for t in tokens[n:]:\n"
                  "            self.kids.append({})\n"
                  "            self.ends.append(False)\n"
                  "            self.kids[node][t] = len(self.kids) - 1\n"
                  "            node = len(self.kids) - 1\n"
                  "        if tokens:\n"
                  "            self.ends[node] = True\n"
                  "        return n\n"
                  "    def match_prefix(self, tokens):\n"
                  "        return self._walk(tokens)[1]\n"
                  "    def num_nodes(self):\n"
                  "        return sum(1 for i in range(1, len(self.kids)) if self.ends[i] or len(self.kids[i]) != 1)\n"],
    },
    "lab04/bounded_load_pick": {
        "wrong": ["def bounded_load_pick(candidates, loads, c):\n"
                  "    return list(candidates)[0]  # pure prefix affinity: the key's home, however loaded\n",
                  "import math\n"
                  "def bounded_load_pick(candidates, loads, c):\n"
                  "    cap = math.ceil(c * sum(loads) / len(loads))  # forgot the request being placed\n"
                  "    return next(r for r in candidates if loads[r] + 1 <= cap)\n"],
        "right": ["def bounded_load_pick(candidates, loads, c):\n"
                  "    n = len(loads)\n"
                  "    limit = -(-c * (sum(loads) + 1) // n)  # ceil by floor division\n"
                  "    for r in candidates:\n"
                  "        if loads[r] < limit:\n"
                  "            return r\n"],
    },
    # ---- Lab 05 -------------------------------------------------------------------------------
    "lab05/kv_cache_size": {
        "wrong": ["def kv_cache_size(config, num_tokens, batch=1, dtype_bytes=2):\n"
                  "    L = config['num_hidden_layers']\n"
                  "    if config.get('kv_lora_rank'):\n"
                  "        return L * (config['kv_lora_rank'] + config['qk_rope_head_dim']) * dtype_bytes * num_tokens * batch\n"
                  "    h = config['num_attention_heads']\n"
                  "    d = config.get('head_dim') or config['hidden_size'] // h\n"
                  "    return L * (config.get('num_key_value_heads') or h) * d * dtype_bytes * num_tokens * batch  # K only\n",
                  "def kv_cache_size(config, num_tokens, batch=1, dtype_bytes=2):\n"
                  "    L = config['num_hidden_layers']\n"
                  "    if config.get('kv_lora_rank'):  # 'K and V' of the latent: twice\n"
                  "        return 2 * L * (config['kv_lora_rank'] + config['qk_rope_head_dim']) * dtype_bytes * num_tokens * batch\n"
                  "    h = config['num_attention_heads']\n"
                  "    d = config.get('head_dim') or config['hidden_size'] // h\n"
                  "    return 2 * L * (config.get('num_key_value_heads') or h) * d * dtype_bytes * num_tokens * batch\n",
                  "def kv_cache_size(config, num_tokens, batch=1, dtype_bytes=2):\n"
                  "    h = config['num_attention_heads']  # MLA ignored: its KV heads and hidden / heads\n"
                  "    d = config.get('head_dim') or config['hidden_size'] // h\n"
                  "    return 2 * config['num_hidden_layers'] * (config.get('num_key_value_heads') or h) * d * dtype_bytes * num_tokens * batch\n"],
        "right": ["def kv_cache_size(config, num_tokens, batch=1, dtype_bytes=2):\n"
                  "    tokens = num_tokens * batch\n"
                  "    if 'kv_lora_rank' in config and config['kv_lora_rank']:\n"
                  "        elems_per_layer = config['kv_lora_rank'] + config['qk_rope_head_dim']  # c_kv + k_pe\n"
                  "    else:\n"
                  "        heads = config['num_attention_heads']\n"
                  "        kv = config['num_key_value_heads'] if config.get('num_key_value_heads') else heads\n"
                  "        dim = config['head_dim'] if config.get('head_dim') else config['hidden_size'] // heads\n"
                  "        elems_per_layer = kv * dim * 2  # K, V\n"
                  "    return tokens * config['num_hidden_layers'] * elems_per_layer * dtype_bytes\n"],
    },
    "lab05/gqa_attention": {
        "wrong": ["import math\nimport torch\n"
                  "def gqa_attention(q, k, v, causal=False):\n"
                  "    g = q.shape[1] // k.shape[1]\n"
                  "    k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)  # head h reads KV head h % Hkv\n"
                  "    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
                  "    if causal:\n"
                  "        nq, nk = s.shape[-2:]\n"
                  "        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(nk - nq + 1), float('-inf'))\n"
                  "    return torch.softmax(s, -1) @ v\n",
                  "import math\nimport torch\n"
                  "def gqa_attention(q, k, v, causal=False):\n"
                  "    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)\n"
                  "    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)\n"
                  "    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])\n"
                  "    if causal:  # top-left aligned: wrong once there are cached keys\n"
                  "        nq, nk = s.shape[-2:]\n"
                  "        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(1), float('-inf'))\n"
                  "    return torch.softmax(s, -1) @ v\n"],
        "right": ["import torch\n"
                  "def gqa_attention(q, k, v, causal=False):\n"
                  "    B, H, Nq, D = q.shape\n"
                  "    Hkv, Nk = k.shape[1], k.shape[2]\n"
                  "    qg = q.reshape(B, Hkv, H // Hkv, Nq, D)  # consecutive query heads share a KV head\n"
                  "    s = torch.einsum('bkgqd,bknd->bkgqn', qg, k) * D ** -0.5\n"
                  "    if causal:\n"
                  "        pos_q = torch.arange(Nk - Nq, Nk)[:, None]\n"
                  "        s = torch.where(torch.arange(Nk)[None, :] <= pos_q, s, torch.tensor(float('-inf')))\n"
                  "    p = (s - s.amax(-1, keepdim=True)).exp()\n"
                  "    p = p / p.sum(-1, keepdim=True)\n"
                  "    return torch.einsum('bkgqn,bknd->bkgqd', p, v).reshape(B, H, Nq, D)\n"],
    },
    "lab05/mean_pool_kv_heads": {
        "wrong": ["def mean_pool_kv_heads(t, num_kv_heads, new_num_kv_heads):\n"
                  "    g = num_kv_heads // new_num_kv_heads  # interleaved: heads j, j + new, j + 2 new, ...\n"
                  "    heads = t.reshape(g, new_num_kv_heads, t.shape[0] // num_kv_heads, *t.shape[1:])\n"
                  "    return heads.mean(0).reshape(-1, *t.shape[1:])\n",
                  "def mean_pool_kv_heads(t, num_kv_heads, new_num_kv_heads):\n"
                  "    g = num_kv_heads // new_num_kv_heads  # averages rows, not heads\n"
                  "    return t.reshape(t.shape[0] // g, g, *t.shape[1:]).mean(1)\n"],
        "right": ["import torch\n"
                  "def mean_pool_kv_heads(t, num_kv_heads, new_num_kv_heads):\n"
                  "    blocks = t.chunk(num_kv_heads, dim=0)\n"
                  "    g = num_kv_heads // new_num_kv_heads\n"
                  "    return torch.cat([sum(blocks[j * g:(j + 1) * g]) / g for j in range(new_num_kv_heads)], dim=0)\n"],
    },
    "lab05/mla_decode_absorbed": {
        "wrong": ["import math\nimport torch\n"
                  "def mla_decode_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):\n"
                  "    scale = 1 / math.sqrt(c_kv.shape[-1] + k_pe.shape[-1])  # the cached row's width\n"
                  "    q_lat = torch.einsum('thd,hdr->thr', q_nope, w_uk)\n"
                  "    p = torch.softmax((q_lat @ c_kv.T + q_pe @ k_pe.T) * scale, dim=-1)\n"
                  "    return torch.einsum('thr,hvr->thv', p @ c_kv, w_uv)\n",
                  "import torch\n"
                  "def mla_decode_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):\n"
                  "    q_lat = torch.einsum('thd,hdr->thr', q_nope, w_uk)\n"
                  "    p = torch.softmax((q_lat @ c_kv.T) * scale, dim=-1)  # forgot the RoPE key\n"
                  "    return torch.einsum('thr,hvr->thv', p @ c_kv, w_uv)\n"],
        "right": ["import torch\n"
                  "def mla_decode_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):\n"
                  "    # the naive way: up-project every cached latent to per-head K and V\n"
                  "    H = q_nope.shape[1]\n"
                  "    k_nope = torch.stack([c_kv @ w_uk[h].T for h in range(H)])        # [H, S, dn]\n"
                  "    v = torch.stack([c_kv @ w_uv[h].T for h in range(H)])             # [H, S, dv]\n"
                  "    k = torch.cat([k_nope, k_pe.expand(H, -1, -1)], dim=-1)           # [H, S, dn + dr]\n"
                  "    q = torch.cat([q_nope, q_pe], dim=-1)[0]                          # [H, dn + dr]\n"
                  "    s = torch.einsum('hd,hsd->hs', q, k) * scale\n"
                  "    return torch.einsum('hs,hsv->hv', s.softmax(-1), v)[None]\n"],
    },
    "lab05/kv_bytes_per_rank": {
        "wrong": ["def kv_bytes_per_rank(num_layers, num_heads, num_kv_heads, head_dim, tp, dtype_bytes=2):\n"
                  "    return 2 * num_layers * (num_kv_heads // tp) * head_dim * dtype_bytes  # 0 heads past tp = Hkv\n",
                  "def kv_bytes_per_rank(num_layers, num_heads, num_kv_heads, head_dim, tp, dtype_bytes=2):\n"
                  "    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes / tp  # half a head per rank\n"],
        "right": ["import math\n"
                  "def kv_bytes_per_rank(num_layers, num_heads, num_kv_heads, head_dim, tp, dtype_bytes=2):\n"
                  "    full = 2 * num_layers * num_kv_heads * head_dim * dtype_bytes\n"
                  "    copies = math.ceil(tp / num_kv_heads)  # each KV head lives on this many ranks\n"
                  "    return full * copies // tp\n"],
    },
    "lab06/fake_quantize": {
        "wrong": ["import torch\n"
                  "def fake_quantize(w, bits, group_size=None, symmetric=True):\n"
                  "    out_f, in_f = w.shape\n"
                  "    g = in_f if group_size is None else group_size\n"
                  "    x = w.reshape(out_f, in_f // g, g)\n"
                  "    if symmetric:\n"
                  "        scale = x.abs().amax(-1, keepdim=True) / 2 ** (bits - 1)  # 8 levels up for int4, not 7\n"
                  "        return (torch.clamp(torch.round(x / scale), -2 ** (bits - 1), 2 ** (bits - 1) - 1) * scale).reshape(w.shape)\n"
                  "    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)\n"
                  "    scale = (hi - lo) / (2 ** bits - 1)\n"
                  "    return (torch.clamp(torch.round((x - lo) / scale), 0, 2 ** bits - 1) * scale + lo).reshape(w.shape)\n",
                  "import torch\n"
                  "def fake_quantize(w, bits, group_size=None, symmetric=True):\n"
                  "    out_f, in_f = w.shape\n"
                  "    g = in_f if group_size is None else group_size\n"
                  "    x = w.reshape(out_f, in_f // g, g)\n"
                  "    if symmetric:\n"
                  "        qmax = 2 ** (bits - 1) - 1\n"
                  "        scale = x.abs().amax(-1, keepdim=True) / qmax\n"
                  "        return (torch.clamp(torch.round(x / scale), -qmax - 1, qmax) * scale).reshape(w.shape)\n"
                  "    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)\n"
                  "    scale = (hi - lo) / (2 ** bits - 1)\n"
                  "    zero = torch.round(-lo / scale)  # an integer zero point: min is no longer exact\n"
                  "    return ((torch.clamp(torch.round(x / scale) + zero, 0, 2 ** bits - 1) - zero) * scale).reshape(w.shape)\n"],
        "right": ["import torch\n"
                  "def fake_quantize(w, bits, group_size=None, symmetric=True):\n"
                  "    g = w.shape[1] if group_size is None else group_size\n"
                  "    cols = []\n"
                  "    for j in range(0, w.shape[1], g):  # one group of columns at a time\n"
                  "        x = w[:, j:j + g]\n"
                  "        if symmetric:\n"
                  "            step = (x.abs().max(dim=1, keepdim=True).values / (2 ** (bits - 1) - 1)).clamp(min=1e-12)\n"
                  "            cols.append((x / step).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * step)\n"
                  "        else:\n"
                  "            lo = x.min(dim=1, keepdim=True).values\n"
                  "            step = ((x.max(dim=1, keepdim=True).values - lo) / (2 ** bits - 1)).clamp(min=1e-12)\n"
                  "            cols.append(((x - lo) / step).round().clamp(0, 2 ** bits - 1) * step + lo)\n"
                  "    return torch.cat(cols, dim=1)\n"],
    },
    "lab06/pack_int4": {
        "wrong": ["def pack_int4(codes):\n"
                  "    return (codes[..., 0::2] << 4) | codes[..., 1::2]  # even index in the high nibble\n",
                  "import torch\n"
                  "def pack_int4(codes):\n"
                  "    half = codes.shape[-1] // 2  # ggml's block order: j with j + n/2, not neighbours\n"
                  "    return codes[..., :half] | (codes[..., half:] << 4)\n"],
        "right": ["import torch\n"
                  "def pack_int4(codes):\n"
                  "    pairs = codes.reshape(*codes.shape[:-1], -1, 2).to(torch.int32)\n"
                  "    return (pairs[..., 0] + 16 * pairs[..., 1]).to(torch.uint8)\n"],
    },
    "lab06/smoothquant_scales": {
        "wrong": ["import torch\n"
                  "def smoothquant_scales(act_absmax, weights, alpha=0.5):\n"
                  "    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)\n"
                  "    w_absmax = ws[0].abs().amax(0)  # only the first weight (q), not k and v\n"
                  "    return act_absmax.clamp_min(1e-5) ** alpha / w_absmax.clamp_min(1e-5) ** (1 - alpha)\n",
                  "import torch\n"
                  "def smoothquant_scales(act_absmax, weights, alpha=0.5):\n"
                  "    ws = [weights] if isinstance(weights, torch.Tensor) else list(weights)\n"
                  "    w_absmax = torch.cat(ws).abs().amax(0)\n"
                  "    return act_absmax.clamp_min(1e-5) ** (1 - alpha) / w_absmax.clamp_min(1e-5) ** alpha  # exponents swapped\n"],
        "right": ["import torch\n"
                  "def smoothquant_scales(act_absmax, weights, alpha=0.5):\n"
                  "    if isinstance(weights, torch.Tensor):\n"
                  "        weights = [weights]\n"
                  "    w_absmax = torch.stack([w.abs().max(dim=0).values for w in weights]).max(dim=0).values\n"
                  "    a, b = act_absmax.clamp(min=1e-5), w_absmax.clamp(min=1e-5)\n"
                  "    return torch.exp(alpha * torch.log(a) - (1 - alpha) * torch.log(b))\n"],
    },
    "lab06/awq_scale_search": {
        "wrong": ['from llmso_lab.quant.rtn import fake_quantize as rtn_fake_quantize\n'
                  'def awq_scale_search(w, x, bits=4, group_size=64, grid=20):\n'
                  '    s_x = x.abs().mean(0)\n'
                  '    best = None\n'
                  '    for i in range(1, grid):  # the grid starts at 1/grid: alpha 0 (plain RTN) is never tried\n'
                  '        s = s_x.pow(i / grid).clamp_min(1e-4)\n'
                  '        s = s / (s.max() * s.min()).sqrt()\n'
                  '        w_q = rtn_fake_quantize(w * s, bits, group_size=group_size, symmetric=True) / s\n'
                  '        loss = (x @ w_q.T - x @ w.T).pow(2).mean()\n'
                  '        if best is None or loss < best[0]:\n'
                  '            best = (loss, s)\n'
                  '    return best[1]\n',
                  "from llmso_lab.quant.rtn import fake_quantize as rtn_fake_quantize\n"
                  "def awq_scale_search(w, x, bits=4, group_size=64, grid=20):\n"
                  "    s_x = x.abs().mean(0)\n"
                  "    best = None\n"
                  "    for i in range(grid):\n"
                  "        s = s_x.pow(i / grid).clamp_min(1e-4)\n"
                  "        s = s / (s.max() * s.min()).sqrt()\n"
                  "        w_q = rtn_fake_quantize(w * s, bits, group_size=group_size, symmetric=True)  # forgot / s\n"
                  "        loss = (x @ w_q.T - x @ w.T).pow(2).mean()\n"
                  "        if best is None or loss < best[0]:\n"
                  "            best = (loss, s)\n"
                  "    return best[1]\n",
                  "from llmso_lab.quant.rtn import fake_quantize as rtn_fake_quantize\n"
                  "def awq_scale_search(w, x, bits=4, group_size=64, grid=20):\n"
                  "    s_w = w.abs().mean(0)  # salient by weight magnitude, not by activation\n"
                  "    best = None\n"
                  "    for i in range(grid):\n"
                  "        s = s_w.pow(i / grid).clamp_min(1e-4)\n"
                  "        s = s / (s.max() * s.min()).sqrt()\n"
                  "        w_q = rtn_fake_quantize(w * s, bits, group_size=group_size, symmetric=True) / s\n"
                  "        loss = (x @ w_q.T - x @ w.T).pow(2).mean()\n"
                  "        if best is None or loss < best[0]:\n"
                  "            best = (loss, s)\n"
                  "    return best[1]\n"],
        "right": ["import torch\n"
                  "from llmso_lab.quant.rtn import fake_quantize as rtn_fake_quantize\n"
                  "def awq_scale_search(w, x, bits=4, group_size=64, grid=20):\n"
                  "    s_x = x.abs().sum(0) / x.shape[0]\n"
                  "    candidates, losses = [], []\n"
                  "    for alpha in [i / grid for i in range(grid)]:\n"
                  "        s = torch.clamp(s_x ** alpha, min=1e-4)\n"
                  "        s = s / torch.sqrt(s.max() * s.min())\n"
                  "        err = x @ (rtn_fake_quantize(w * s, bits, group_size=group_size, symmetric=True) / s - w).T\n"
                  "        candidates.append(s)\n"
                  "        losses.append(float((err ** 2).sum()))  # a sum: the same argmin as the mean\n"
                  "    return candidates[losses.index(min(losses))]\n"],
    },
    "lab06/mask_2_4": {
        "wrong": ["import torch\n"
                  "def mask_2_4(w):\n"
                  "    g = w.reshape(w.shape[0], -1, 4)  # by signed value, not magnitude\n"
                  "    top2 = torch.argsort(g, dim=-1, descending=True, stable=True)[..., :2]\n"
                  "    return torch.zeros_like(g, dtype=torch.bool).scatter_(-1, top2, True).reshape(w.shape)\n",
                  "import torch\n"
                  "def mask_2_4(w):\n"
                  "    g = w.abs().reshape(-1, 4, w.shape[1] // 4).transpose(1, 2)  # groups strided across the row\n"
                  "    top2 = torch.argsort(g, dim=-1, descending=True, stable=True)[..., :2]\n"
                  "    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, top2, True)\n"
                  "    return keep.transpose(1, 2).reshape(w.shape)\n"],
        "right": ["import torch\n"
                  "def mask_2_4(w):\n"
                  "    mask = torch.zeros(w.shape, dtype=torch.bool)\n"
                  "    a = w.abs()\n"
                  "    for r in range(w.shape[0]):\n"
                  "        for j in range(0, w.shape[1], 4):\n"
                  "            order = sorted(range(4), key=lambda k: (-a[r, j + k].item(), k))  # ties: earlier first\n"
                  "            for k in order[:2]:\n"
                  "                mask[r, j + k] = True\n"
                  "    return mask\n"],
    },
    "lab06/distillation_loss": {
        "wrong": ["import torch\n"
                  "def distillation_loss(student_logits, teacher_logits, labels, T=2.0, alpha=0.5):\n"
                  "    V = student_logits.shape[-1]\n"
                  "    log_q = torch.log_softmax(student_logits.reshape(-1, V) / T, -1)\n"
                  "    log_p = torch.log_softmax(teacher_logits.reshape(-1, V) / T, -1)\n"
                  "    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()  # no T^2\n"
                  "    ce = torch.nn.functional.cross_entropy(student_logits.reshape(-1, V), labels.reshape(-1))\n"
                  "    return alpha * kl + (1 - alpha) * ce\n",
                  "import torch\n"
                  "def distillation_loss(student_logits, teacher_logits, labels, T=2.0, alpha=0.5):\n"
                  "    V = student_logits.shape[-1]\n"
                  "    log_q = torch.log_softmax(student_logits.reshape(-1, V) / T, -1)\n"
                  "    log_p = torch.log_softmax(teacher_logits.reshape(-1, V) / T, -1)\n"
                  "    kl = (log_q.exp() * (log_q - log_p)).sum(-1).mean()  # KL(student || teacher): the other direction\n"
                  "    ce = torch.nn.functional.cross_entropy(student_logits.reshape(-1, V), labels.reshape(-1))\n"
                  "    return alpha * T * T * kl + (1 - alpha) * ce\n"],
        "right": ["import torch\n"
                  "import torch.nn.functional as F\n"
                  "def distillation_loss(student_logits, teacher_logits, labels, T=2.0, alpha=0.5):\n"
                  "    V = student_logits.shape[-1]\n"
                  "    s, t = student_logits.reshape(-1, V), teacher_logits.reshape(-1, V)\n"
                  "    kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), reduction='batchmean', log_target=True)\n"
                  "    return alpha * T ** 2 * kl + (1 - alpha) * F.cross_entropy(s, labels.reshape(-1))\n"],
    },
    "lab07/speculative_verify": {
        "wrong": ["import torch\n"
                  "def speculative_verify(target_probs, draft_probs, draft_tokens, accept_u, exp_noise):\n"
                  "    out = []\n"
                  "    for i, d in enumerate(draft_tokens.tolist()):\n"
                  "        if target_probs[i, d] >= draft_probs[i, d]:  # accept only when p >= q: never with prob p/q\n"
                  "            out.append(d)\n"
                  "            continue\n"
                  "        res = (target_probs[i] - draft_probs[i]).clamp(min=0)\n"
                  "        dist = res if (res > 0).any() else target_probs[i]\n"
                  "        out.append(int(torch.where(dist > 0, dist / exp_noise, -1.0).argmax()))\n"
                  "        return out\n"
                  "    k = len(out)\n"
                  "    out.append(int(torch.where(target_probs[k] > 0, target_probs[k] / exp_noise, -1.0).argmax()))\n"
                  "    return out\n",
                  "import torch\n"
                  "def speculative_verify(target_probs, draft_probs, draft_tokens, accept_u, exp_noise):\n"
                  "    out = []\n"
                  "    for i, d in enumerate(draft_tokens.tolist()):\n"
                  "        if accept_u[i] * draft_probs[i, d] < target_probs[i, d]:\n"
                  "            out.append(d)\n"
                  "            continue\n"
                  "        dist = target_probs[i]  # resample from p, not from the residual max(0, p - q)\n"
                  "        out.append(int(torch.where(dist > 0, dist / exp_noise, -1.0).argmax()))\n"
                  "        return out\n"
                  "    return out  # forgot the bonus token after all drafts are accepted\n"],
        "right": ["import torch\n"
                  "def speculative_verify(target_probs, draft_probs, draft_tokens, accept_u, exp_noise):\n"
                  "    d = torch.as_tensor(draft_tokens).long()\n"
                  "    k = d.numel()\n"
                  "    idx = torch.arange(k)\n"
                  "    p_d, q_d = target_probs[idx, d], draft_probs[idx, d]\n"
                  "    ok = (accept_u < p_d / q_d).long()  # u < p/q, as a division\n"
                  "    n = int(ok.cumprod(0).sum()) if k else 0\n"
                  "    if n < k:\n"
                  "        dist = (target_probs[n] - draft_probs[n]).clamp(min=0)\n"
                  "        if not bool((dist > 0).any()):\n"
                  "            dist = target_probs[n]\n"
                  "    else:\n"
                  "        dist = target_probs[k]\n"
                  "    score = dist * (1.0 / exp_noise)\n"
                  "    score[dist <= 0] = -1.0\n"
                  "    return d[:n].tolist() + [int(score.argmax())]\n"],
    },
    "lab07/greedy_verify": {
        "wrong": ["def greedy_verify(target_argmax, draft_tokens):\n"
                  "    out = []\n"
                  "    for d, t in zip(draft_tokens, target_argmax):\n"
                  "        if d != t:\n"
                  "            break\n"
                  "        out.append(d)\n"
                  "    return out  # no token from the target: a rejected first draft emits nothing\n",
                  "def greedy_verify(target_argmax, draft_tokens):\n"
                  "    out = [d for d, t in zip(draft_tokens, target_argmax) if d == t]  # keeps drafts after a mismatch\n"
                  "    return out + [list(target_argmax)[len(out)]]\n"],
        "right": ["def greedy_verify(target_argmax, draft_tokens):\n"
                  "    t, d = list(target_argmax), list(draft_tokens)\n"
                  "    n = next((i for i in range(len(d)) if d[i] != t[i]), len(d))\n"
                  "    return d[:n] + [t[n]]\n"],
    },
    "lab07/ngram_propose": {
        "wrong": ["def ngram_propose(token_ids, k, n_min=2, n_max=4):\n"
                  "    t = list(token_ids)\n"
                  "    for n in range(n_max, n_min - 1, -1):\n"
                  "        suffix = t[len(t) - n:]\n"
                  "        for i in range(len(t) - n - 1, -1, -1):  # the most recent occurrence, not the earliest\n"
                  "            if t[i:i + n] == suffix:\n"
                  "                return t[i + n:i + n + k]\n"
                  "    return []\n",
                  "def ngram_propose(token_ids, k, n_min=2, n_max=4):\n"
                  "    t = list(token_ids)\n"
                  "    for n in range(n_min, n_max + 1):  # the shortest n first\n"
                  "        suffix = t[len(t) - n:]\n"
                  "        for i in range(len(t) - n):\n"
                  "            if t[i:i + n] == suffix:\n"
                  "                return t[i + n:i + n + k]\n"
                  "    return []\n"],
        "right": ["def ngram_propose(token_ids, k, n_min=2, n_max=4):\n"
                  "    s = ',' + ','.join(map(str, token_ids)) + ','\n"
                  "    t = list(token_ids)\n"
                  "    for n in range(min(n_max, len(t) - 1), n_min - 1, -1):\n"
                  "        key = ',' + ','.join(map(str, t[len(t) - n:])) + ','\n"
                  "        pos = s.find(key)  # the earliest occurrence, as a string search\n"
                  "        if pos != -1 and pos < len(s) - len(key):\n"
                  "            start = s[:pos + 1].count(',') - 1 + n\n"
                  "            return t[start:start + k]\n"
                  "    return []\n"],
    },
    "lab07/expected_tokens_per_step": {
        "wrong": ["def expected_tokens_per_step(alpha, k):\n"
                  "    return (1 - alpha ** k) / (1 - alpha) if alpha < 1 else float(k)  # forgets the bonus token\n",
                  "def expected_tokens_per_step(alpha, k):\n"
                  "    return 1 + alpha * k  # linear: as if each draft were accepted independently of the ones before\n"],
        "right": ["def expected_tokens_per_step(alpha, k):\n"
                  "    return float(sum(alpha ** i for i in range(k + 1)))\n"],
    },
    "lab07/speculative_speedup": {
        "wrong": ["def speculative_speedup(alpha, k, c):\n"
                  "    e = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)\n"
                  "    return e / (k * c)  # forgets the target's own forward\n",
                  "def speculative_speedup(alpha, k, c):\n"
                  "    e = k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)\n"
                  "    return e / (c + 1)  # one draft forward instead of k\n"],
        "right": ["def speculative_speedup(alpha, k, c):\n"
                  "    tokens = 1.0\n"
                  "    run = 1.0\n"
                  "    for _ in range(k):\n"
                  "        run *= alpha\n"
                  "        tokens += run\n"
                  "    return tokens / (1 + k * c)\n"],
    },
    "lab07/rollback_blocks": {
        "wrong": ["def rollback_blocks(block_table, block_size, num_tokens):\n"
                  "    keep = num_tokens // block_size  # drops the partly filled last block\n"
                  "    return list(block_table[:keep]), list(block_table[keep:])\n",
                  "def rollback_blocks(block_table, block_size, num_tokens):\n"
                  "    keep = num_tokens // block_size + 1  # one block too many when the tokens fill whole blocks\n"
                  "    return list(block_table[:keep]), list(block_table[keep:])\n"],
        "right": ["import math\n"
                  "def rollback_blocks(block_table, block_size, num_tokens):\n"
                  "    kept, freed = [], []\n"
                  "    for i, b in enumerate(block_table):\n"
                  "        (kept if i < math.ceil(num_tokens / block_size) else freed).append(b)\n"
                  "    return kept, freed\n"],
    },
    "lab08/shard_linear": {
        "wrong": ['import torch\n'
                  'def shard_linear(weight, rank, tp, style):\n'
                  "    dim = 0 if style == 'column' else 1  # no ValueError: an unknown style is taken as row, chunk splits unevenly\n"
                  '    return torch.chunk(weight, tp, dim=dim)[rank].contiguous()\n',
                  "def shard_linear(weight, rank, tp, style):\n"
                  "    dim = 1 if style == 'column' else 0  # rows and columns swapped: column-parallel splits the inputs\n"
                  "    step = weight.shape[dim] // tp\n"
                  "    return weight.narrow(dim, rank * step, step)\n",
                  "def shard_linear(weight, rank, tp, style):\n"
                  "    return weight[rank::tp] if style == 'column' else weight[:, rank::tp]  # strided, not contiguous\n"],
        "right": ["import torch\n"
                  "def shard_linear(weight, rank, tp, style):\n"
                  "    dims = {'column': 0, 'row': 1}\n"
                  "    if style not in dims:\n"
                  "        raise ValueError(f'unknown style {style!r}')\n"
                  "    if weight.shape[dims[style]] % tp:\n"
                  "        raise ValueError('uneven split')\n"
                  "    return torch.chunk(weight, tp, dim=dims[style])[rank].contiguous()\n"],
    },
    "lab08/tp_allreduces_per_token": {
        "wrong": ["def tp_allreduces_per_token(num_layers):\n"
                  "    return num_layers  # one per layer: forgets the MLP's (or the attention's) partial sums\n",
                  "def tp_allreduces_per_token(num_layers):\n"
                  "    return 4 * num_layers  # one after each of q/k/v/o-style projections and the MLP: too many\n"],
        "right": ["def tp_allreduces_per_token(num_layers):\n"
                  "    per_layer = ['attention o_proj', 'mlp down_proj']\n"
                  "    return len(per_layer) * num_layers\n"],
    },
    "lab08/allreduce_time": {
        "wrong": ["def allreduce_time(nbytes, n, link):\n"
                  "    if n == 1:\n"
                  "        return 0.0\n"
                  "    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency  # only the reduce-scatter\n",
                  "def allreduce_time(nbytes, n, link):\n"
                  "    return 2 * n / n * nbytes / link.bandwidth + 2 * n * link.latency  # n steps instead of n - 1\n",
                  "def allreduce_time(nbytes, n, link):\n"
                  "    if n == 1:\n"
                  "        return 0.0\n"
                  "    return 2 * (n - 1) / n * nbytes / link.bandwidth  # forgets the per-message latency\n"],
        "right": ["def allreduce_time(nbytes, n, link):\n"
                  "    t = 0.0\n"
                  "    for phase in ('reduce-scatter', 'all-gather'):\n"
                  "        for step in range(n - 1):\n"
                  "            t += link.transfer_time(nbytes / n)  # one chunk to the next rank\n"
                  "    return t\n"],
    },
    "lab08/bubble_fraction": {
        "wrong": ["def bubble_fraction(num_stages, num_microbatches):\n"
                  "    return (num_stages - 1) / num_microbatches  # the bubble over the useful time, not over the total\n",
                  "def bubble_fraction(num_stages, num_microbatches):\n"
                  "    return (num_stages - 1) / (num_microbatches + num_stages)  # one slot too many\n"],
        "right": ["def bubble_fraction(num_stages, num_microbatches):\n"
                  "    slots = num_microbatches + num_stages - 1\n"
                  "    return 1 - num_microbatches / slots\n"],
    },
    "lab08/dispatch_indices": {
        "wrong": ["import torch\n"
                  "def dispatch_indices(experts, num_experts, capacity):\n"
                  "    slot = torch.full(experts.shape, -1, dtype=torch.int64)\n"
                  "    filled = [0] * num_experts\n"
                  "    for j in range(experts.shape[1]):  # choice order first: every token's first choice, then the second\n"
                  "        for t in range(experts.shape[0]):\n"
                  "            e = int(experts[t, j])\n"
                  "            if capacity is None or filled[e] < capacity:\n"
                  "                slot[t, j] = filled[e]\n"
                  "                filled[e] += 1\n"
                  "    return slot\n",
                  "import torch\n"
                  "def dispatch_indices(experts, num_experts, capacity):\n"
                  "    flat = experts.reshape(-1)\n"
                  "    pos = torch.nn.functional.one_hot(flat, num_experts).cumsum(0).gather(1, flat[:, None])[:, 0] - 1\n"
                  "    if capacity is not None:\n"
                  "        pos[pos > capacity] = -1  # keeps capacity + 1 choices\n"
                  "    return pos.view(experts.shape)\n",
                  "import torch\n"
                  "def dispatch_indices(experts, num_experts, capacity):\n"
                  "    slot = torch.full(experts.shape, -1, dtype=torch.int64)\n"
                  "    filled = [0] * num_experts\n"
                  "    for t in range(experts.shape[0]):\n"
                  "        for j in range(experts.shape[1]):\n"
                  "            e = int(experts[t, j])\n"
                  "            filled[e] += 1\n"
                  "            if capacity is None or filled[e] <= capacity:\n"
                  "                slot[t, j] = filled[e]  # counts from 1: the first choice of an expert gets slot 1\n"
                  "    return slot\n"],
        "right": ["import torch\n"
                  "def dispatch_indices(experts, num_experts, capacity):\n"
                  "    T, k = experts.shape\n"
                  "    seen = {}\n"
                  "    out = []\n"
                  "    for e in experts.reshape(-1).tolist():  # row-major: token order, then choice order\n"
                  "        n = seen.get(e, 0)\n"
                  "        seen[e] = n + 1\n"
                  "        out.append(n if capacity is None or n < capacity else -1)\n"
                  "    return torch.tensor(out, dtype=torch.long).reshape(T, k)\n"],
    },
    "lab08/ring_attention_step": {
        "wrong": ['import torch\n'
                  'def ring_attention_step(o, lse, q, k_blk, v_blk, q_pos, k_pos, scale):\n'
                  '    s = (q.float() @ k_blk.float().transpose(-2, -1)) * scale\n'
                  "    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float('-inf'))\n"
                  '    e = torch.exp(s)  # naive exp merge: no max subtracted, exp overflows fp32 for scores above ~88\n'
                  '    blk_l = e.sum(-1)\n'
                  '    blk_o = (e @ v_blk.float()) / torch.where(blk_l > 0, blk_l, torch.ones_like(blk_l))[..., None]\n'
                  '    old_l = torch.exp(lse)\n'
                  '    tot = old_l + blk_l\n'
                  '    d = torch.where(tot > 0, tot, torch.ones_like(tot))\n'
                  '    return (old_l[..., None] * o + blk_l[..., None] * blk_o) / d[..., None], torch.log(tot)\n',
                  "import torch\n"
                  "def ring_attention_step(o, lse, q, k_blk, v_blk, q_pos, k_pos, scale):\n"
                  "    s = (q.float() @ k_blk.float().transpose(-2, -1)) * scale  # no causal mask\n"
                  "    blk_lse = torch.logsumexp(s, dim=-1)\n"
                  "    blk_o = torch.softmax(s, dim=-1) @ v_blk.float()\n"
                  "    new_lse = torch.logaddexp(lse, blk_lse)\n"
                  "    w_old, w_blk = torch.exp(lse - new_lse), torch.exp(blk_lse - new_lse)\n"
                  "    return w_old[..., None] * o + w_blk[..., None] * blk_o, new_lse\n",
                  "import torch\n"
                  "def ring_attention_step(o, lse, q, k_blk, v_blk, q_pos, k_pos, scale):\n"
                  "    s = (q.float() @ k_blk.float().transpose(-2, -1)) * scale\n"
                  "    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float('-inf'))\n"
                  "    blk_lse = torch.logsumexp(s, dim=-1)\n"
                  "    blk_o = torch.softmax(s, dim=-1).nan_to_num(0.0) @ v_blk.float()\n"
                  "    new_lse = torch.logaddexp(lse, blk_lse)\n"
                  "    w_old, w_blk = torch.exp(lse), torch.exp(blk_lse)  # not divided by exp(new_lse): not renormalised\n"
                  "    return w_old[..., None] * o + w_blk[..., None] * blk_o, new_lse\n",
                  "import torch\n"
                  "def ring_attention_step(o, lse, q, k_blk, v_blk, q_pos, k_pos, scale):\n"
                  "    s = (q.float() @ k_blk.float().transpose(-2, -1)) * scale\n"
                  "    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float('-inf'))\n"
                  "    blk_lse = torch.logsumexp(s, dim=-1)\n"
                  "    blk_o = torch.softmax(s, dim=-1) @ v_blk.float()  # a row with every key masked: NaN\n"
                  "    new_lse = torch.logaddexp(lse, blk_lse)\n"
                  "    w_old, w_blk = torch.exp(lse - new_lse), torch.exp(blk_lse - new_lse)  # -inf - -inf: NaN\n"
                  "    return w_old[..., None] * o + w_blk[..., None] * blk_o, new_lse\n"],
        "right": ["import torch\n"
                  "def ring_attention_step(o, lse, q, k_blk, v_blk, q_pos, k_pos, scale):\n"
                  "    s = torch.einsum('hqd,hkd->hqk', q.float(), k_blk.float()) * scale\n"
                  "    s = torch.where(k_pos[None, None, :] <= q_pos[None, :, None], s, torch.tensor(float('-inf')))\n"
                  "    m = torch.maximum(s.amax(dim=-1), lse)  # online softmax: one running max for old state and block\n"
                  "    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)\n"
                  "    p = torch.exp(s - m[..., None])\n"
                  "    old = torch.exp(lse - m)\n"
                  "    total = old + p.sum(dim=-1)\n"
                  "    num = old[..., None] * o + p @ v_blk.float()\n"
                  "    return num / torch.where(total > 0, total, torch.ones_like(total))[..., None], m + torch.log(total)\n"],
    },
    "lab09/kv_transfer_bytes": {
        "wrong": ['def kv_transfer_bytes(config, num_prompt_tokens, num_cached_tokens=0, dtype_bytes=2):\n'
                  '    if not 0 <= num_cached_tokens <= num_prompt_tokens:\n'
                  "        raise ValueError('num_cached_tokens must lie in [0, num_prompt_tokens]')\n"
                  "    tokens, layers = num_prompt_tokens - num_cached_tokens, config['num_hidden_layers']\n"
                  "    if config.get('kv_lora_rank'):\n"
                  "        return layers * (config['kv_lora_rank'] + config['qk_rope_head_dim']) * dtype_bytes * tokens\n"
                  "    heads = config['num_attention_heads']\n"
                  "    kv_heads = config.get('num_key_value_heads') or heads\n"
                  "    return 2 * layers * kv_heads * (config['hidden_size'] // heads) * dtype_bytes * tokens  # ignores head_dim\n",
                  "def kv_transfer_bytes(config, num_prompt_tokens, num_cached_tokens=0, dtype_bytes=2):\n"
                  "    if not 0 <= num_cached_tokens <= num_prompt_tokens:\n"
                  "        raise ValueError('num_cached_tokens must lie in [0, num_prompt_tokens]')\n"
                  "    tokens, layers = num_prompt_tokens - num_cached_tokens, config['num_hidden_layers']\n"
                  "    if config.get('kv_lora_rank'):\n"
                  "        return layers * (config['kv_lora_rank'] + config['qk_rope_head_dim']) * dtype_bytes * tokens\n"
                  "    heads = config['num_attention_heads']\n"
                  "    kv_heads = config.get('num_key_value_heads') or heads\n"
                  "    head_dim = config.get('head_dim') or config['hidden_size'] // heads\n"
                  "    return layers * kv_heads * head_dim * dtype_bytes * tokens  # K only: no factor 2 for V\n",
                  "def kv_transfer_bytes(config, num_prompt_tokens, num_cached_tokens=0, dtype_bytes=2):\n"
                  "    if not 0 <= num_cached_tokens <= num_prompt_tokens:\n"
                  "        raise ValueError('num_cached_tokens must lie in [0, num_prompt_tokens]')\n"
                  "    tokens, layers = num_prompt_tokens, config['num_hidden_layers']  # sends the cached prefix too\n"
                  "    if config.get('kv_lora_rank'):\n"
                  "        return layers * (config['kv_lora_rank'] + config['qk_rope_head_dim']) * dtype_bytes * tokens\n"
                  "    heads = config['num_attention_heads']\n"
                  "    kv_heads = config.get('num_key_value_heads') or heads\n"
                  "    head_dim = config.get('head_dim') or config['hidden_size'] // heads\n"
                  "    return 2 * layers * kv_heads * head_dim * dtype_bytes * tokens\n",
                  "def kv_transfer_bytes(config, num_prompt_tokens, num_cached_tokens=0, dtype_bytes=2):\n"
                  "    if not 0 <= num_cached_tokens <= num_prompt_tokens:\n"
                  "        raise ValueError('num_cached_tokens must lie in [0, num_prompt_tokens]')\n"
                  "    tokens, layers = num_prompt_tokens - num_cached_tokens, config['num_hidden_layers']\n"
                  "    if config.get('kv_lora_rank'):  # a K and a V of the latent: MLA caches one latent, not two\n"
                  "        return 2 * layers * (config['kv_lora_rank'] + config['qk_rope_head_dim']) * dtype_bytes * tokens\n"
                  "    heads = config['num_attention_heads']\n"
                  "    kv_heads = config.get('num_key_value_heads') or heads\n"
                  "    head_dim = config.get('head_dim') or config['hidden_size'] // heads\n"
                  "    return 2 * layers * kv_heads * head_dim * dtype_bytes * tokens\n",
                  "def kv_transfer_bytes(config, num_prompt_tokens, num_cached_tokens=0, dtype_bytes=2):\n"
                  "    if not 0 <= num_cached_tokens <= num_prompt_tokens:\n"
                  "        raise ValueError('num_cached_tokens must lie in [0, num_prompt_tokens]')\n"
                  "    tokens, layers = num_prompt_tokens - num_cached_tokens, config['num_hidden_layers']\n"
                  "    if config.get('kv_lora_rank'):\n"
                  "        return layers * (config['kv_lora_rank'] + config['qk_rope_head_dim']) * dtype_bytes * tokens\n"
                  "    heads = config['num_attention_heads']\n"
                  "    kv_heads = config.get('num_key_value_heads') or heads\n"
                  "    head_dim = config['hidden_size'] // heads  # ignores an explicit head_dim (Gemma)\n"
                  "    return 2 * layers * kv_heads * head_dim * dtype_bytes * tokens\n"],
        "right": ["import math\n"
                  "def kv_transfer_bytes(config, num_prompt_tokens, num_cached_tokens=0, dtype_bytes=2):\n"
                  "    if num_cached_tokens < 0 or num_cached_tokens > num_prompt_tokens:\n"
                  "        raise ValueError('cached tokens must be between 0 and the prompt length')\n"
                  "    n = num_prompt_tokens - num_cached_tokens\n"
                  "    if 'kv_lora_rank' in config and config['kv_lora_rank']:\n"
                  "        per_layer = [(n, config['kv_lora_rank']), (n, config['qk_rope_head_dim'])]  # c_kv and k_pe\n"
                  "    else:\n"
                  "        h = config['num_attention_heads']\n"
                  "        hkv = config['num_key_value_heads'] if config.get('num_key_value_heads') else h\n"
                  "        d = config['head_dim'] if config.get('head_dim') is not None else config['hidden_size'] // h\n"
                  "        per_layer = [(n, hkv, d), (n, hkv, d)]  # K and V\n"
                  "    return sum(math.prod(shape) * dtype_bytes for _ in range(config['num_hidden_layers'])\n"
                  "               for shape in per_layer)\n"],
    },
    "lab09/exposed_transfer_time": {
        "wrong": ['def exposed_transfer_time(compute_s, transfer_s, layerwise=True):\n'
                  '    if not layerwise:\n'
                  '        return sum(transfer_s)\n'
                  '    # closed form from the first and the last layer only: misses a backlog that starts in the middle\n'
                  '    return max(transfer_s[-1], sum(transfer_s) - sum(compute_s[1:]))\n',
                  "def exposed_transfer_time(compute_s, transfer_s, layerwise=True):\n"
                  "    return transfer_s[-1] if layerwise else sum(transfer_s)  # ignores the backlog of a slow link\n",
                  "def exposed_transfer_time(compute_s, transfer_s, layerwise=True):\n"
                  "    return sum(transfer_s)  # as if layer-wise sending hid nothing\n",
                  "def exposed_transfer_time(compute_s, transfer_s, layerwise=True):\n"
                  "    total = sum(compute_s)\n"
                  "    if not layerwise:\n"
                  "        return sum(transfer_s)\n"
                  "    done, end = 0.0, 0.0\n"
                  "    for c, t in zip(compute_s, transfer_s):\n"
                  "        done += c\n"
                  "        end = max(end, done + t)  # starts each transfer at once, even while the link is busy\n"
                  "    return end - total\n"],
        "right": ["import itertools\n"
                  "def exposed_transfer_time(compute_s, transfer_s, layerwise=True):\n"
                  "    total = sum(compute_s)\n"
                  "    if not layerwise:\n"
                  "        return float(sum(transfer_s))\n"
                  "    done = list(itertools.accumulate(compute_s))\n"
                  "    # the link's last busy stretch starts when some layer i is done and does not pause after it\n"
                  "    return max(done[i] + sum(transfer_s[i:]) for i in range(len(done))) - total\n",
                  "def exposed_transfer_time(compute_s, transfer_s, layerwise=True):\n"
                  "    if not layerwise:\n"
                  "        return sum(transfer_s)\n"
                  "    backlog = 0.0  # link work still queued when a layer finishes\n"
                  "    for c, t in zip(compute_s, transfer_s):\n"
                  "        backlog = max(0.0, backlog - c) + t  # the link drains while the layer computes\n"
                  "    return backlog\n"],
    },
    "lab09/best_pd_ratio": {
        "wrong": ["def best_pd_ratio(total_instances, input_len, output_len, prefill_tokens_per_s, decode_tokens_per_s):\n"
                  "    if total_instances < 2:\n"
                  "        raise ValueError('need at least one instance per pool')\n"
                  "    x = round(total_instances * input_len / (input_len + output_len))  # lengths only, rates ignored\n"
                  "    x = min(max(x, 1), total_instances - 1)\n"
                  "    return x, total_instances - x\n",
                  "def best_pd_ratio(total_instances, input_len, output_len, prefill_tokens_per_s, decode_tokens_per_s):\n"
                  "    if total_instances < 2:\n"
                  "        raise ValueError('need at least one instance per pool')\n"
                  "    best = None\n"
                  "    for x in range(1, total_instances):\n"
                  "        y = total_instances - x\n"
                  "        rate = min(x * prefill_tokens_per_s / input_len, y * decode_tokens_per_s / output_len)\n"
                  "        if best is None or rate >= best[0]:  # a tie goes to the most prefill instances\n"
                  "            best = (rate, x, y)\n"
                  "    return best[1], best[2]\n",
                  "def best_pd_ratio(total_instances, input_len, output_len, prefill_tokens_per_s, decode_tokens_per_s):\n"
                  "    if total_instances < 2:\n"
                  "        raise ValueError('need at least one instance per pool')\n"
                  "    x = max(range(1, total_instances),  # balances tokens/s, not requests/s: lengths ignored\n"
                  "            key=lambda x: (min(x * prefill_tokens_per_s, (total_instances - x) * decode_tokens_per_s), -x))\n"
                  "    return x, total_instances - x\n"],
        "right": ["import math\n"
                  "def best_pd_ratio(total_instances, input_len, output_len, prefill_tokens_per_s, decode_tokens_per_s):\n"
                  "    if total_instances < 2:\n"
                  "        raise ValueError('need at least 2 instances')\n"
                  "    a = prefill_tokens_per_s / input_len   # requests/s of one prefill instance\n"
                  "    b = decode_tokens_per_s / output_len   # requests/s of one decode instance\n"
                  "    x0 = total_instances * b / (a + b)     # where x * a = (total - x) * b\n"
                  "    cands = {min(max(x, 1), total_instances - 1) for x in (math.floor(x0), math.ceil(x0))}\n"
                  "    x = max(sorted(cands), key=lambda x: (min(x * a, (total_instances - x) * b), -x))\n"
                  "    return x, total_instances - x\n",
                  "def best_pd_ratio(total_instances, input_len, output_len, prefill_tokens_per_s, decode_tokens_per_s):\n"
                  "    if total_instances < 2:\n"
                  "        raise ValueError('need at least 2 instances')\n"
                  "    plans = [(x, total_instances - x) for x in range(total_instances - 1, 0, -1)]\n"
                  "    def served(p):\n"
                  "        return min(p[0] * prefill_tokens_per_s / input_len, p[1] * decode_tokens_per_s / output_len)\n"
                  "    best = max(served(p) for p in plans)\n"
                  "    return min(p for p in plans if served(p) == best)\n"],
    },
    "lab09/pd_route": {
        "wrong": ["def pd_route(num_prompt_tokens, num_cached_tokens, prefill_queue_tokens, max_local_prefill_tokens=0,\n"
                  "             max_prefill_queue_tokens=None):\n"
                  "    if not prefill_queue_tokens or num_prompt_tokens <= max_local_prefill_tokens:  # whole prompt, cache ignored\n"
                  "        return -1\n"
                  "    best = min(range(len(prefill_queue_tokens)), key=lambda i: (prefill_queue_tokens[i], i))\n"
                  "    if max_prefill_queue_tokens is not None and prefill_queue_tokens[best] >= max_prefill_queue_tokens:\n"
                  "        return -1\n"
                  "    return best\n",
                  "def pd_route(num_prompt_tokens, num_cached_tokens, prefill_queue_tokens, max_local_prefill_tokens=0,\n"
                  "             max_prefill_queue_tokens=None):\n"
                  "    if not prefill_queue_tokens or num_prompt_tokens - num_cached_tokens <= max_local_prefill_tokens:\n"
                  "        return -1\n"
                  "    best = max(range(len(prefill_queue_tokens)), key=lambda i: (prefill_queue_tokens[i], -i))  # most loaded\n"
                  "    if max_prefill_queue_tokens is not None and prefill_queue_tokens[best] >= max_prefill_queue_tokens:\n"
                  "        return -1\n"
                  "    return best\n",
                  "def pd_route(num_prompt_tokens, num_cached_tokens, prefill_queue_tokens, max_local_prefill_tokens=0,\n"
                  "             max_prefill_queue_tokens=None):\n"
                  "    q = prefill_queue_tokens\n"
                  "    if not q or num_prompt_tokens - num_cached_tokens <= max_local_prefill_tokens:\n"
                  "        return -1\n"
                  "    best = len(q) - 1 - q[::-1].index(min(q))  # the last of the least loaded: highest index on ties\n"
                  "    if max_prefill_queue_tokens is not None and q[best] >= max_prefill_queue_tokens:\n"
                  "        return -1\n"
                  "    return best\n",
                  "def pd_route(num_prompt_tokens, num_cached_tokens, prefill_queue_tokens, max_local_prefill_tokens=0,\n"
                  "             max_prefill_queue_tokens=None):\n"
                  "    q = prefill_queue_tokens\n"
                  "    if not q or num_prompt_tokens - num_cached_tokens <= max_local_prefill_tokens:\n"
                  "        return -1\n"
                  "    best = q.index(min(q))\n"
                  "    if max_prefill_queue_tokens is not None and q[best] > max_prefill_queue_tokens:  # a full queue still taken\n"
                  "        return -1\n"
                  "    return best\n"],
        "right": ["def pd_route(num_prompt_tokens, num_cached_tokens, prefill_queue_tokens, max_local_prefill_tokens=0,\n"
                  "             max_prefill_queue_tokens=None):\n"
                  "    to_prefill = num_prompt_tokens - num_cached_tokens\n"
                  "    if to_prefill <= max_local_prefill_tokens:\n"
                  "        return -1\n"
                  "    ranked = sorted(enumerate(prefill_queue_tokens), key=lambda iq: iq[1])  # stable: lowest index first\n"
                  "    if not ranked:\n"
                  "        return -1\n"
                  "    i, queued = ranked[0]\n"
                  "    limit = float('inf') if max_prefill_queue_tokens is None else max_prefill_queue_tokens\n"
                  "    return i if queued < limit else -1\n"],
    },
    # ---- Lab 10 -------------------------------------------------------------------------------
    "lab10/kivi_fake_quantize": {
        "wrong": [kivi(keys_dim="-1"),                              # keys per token, like the values
                  kivi(first="T - n_q"),                            # quantizes the most recent tokens, keeps the oldest
                  kivi(n_q="T // group_size * group_size"),         # no full-precision window
                  kivi().replace("scale = torch.where(scale == 0, torch.ones_like(scale), scale)",
                                 "scale = scale.clamp_min(1e-8)").replace(
                      "((x - lo) / scale).round().clamp(0, 2 ** bits - 1) * scale + lo",
                      "(((x - lo) / scale).round().clamp(0, 2 ** bits - 1) * scale + lo).half().float()")],  # fp16 read-back
        "right": [KIVI_VECTORISED, KIVI_LOOPS],
    },
    "lab10/streaming_keep": {
        "wrong": ['def streaming_keep(seq_len, budget, num_sink=4):\n'
                  '    if budget >= seq_len:  # no ValueError for budget < num_sink + 1\n'
                  '        return torch.arange(seq_len)\n'
                  '    recent = max(budget - num_sink, 0)\n'
                  '    return torch.cat([torch.arange(min(num_sink, budget)), torch.arange(seq_len - recent, seq_len)])\n',
                  "def streaming_keep(seq_len, budget, num_sink=4):\n"
                  "    if budget < num_sink + 1:\n"
                  "        raise ValueError('budget must exceed num_sink')\n"
                  "    if budget >= seq_len:\n"
                  "        return torch.arange(seq_len)\n"
                  "    return torch.arange(seq_len - budget, seq_len)  # no sinks: only the most recent\n",
                  "def streaming_keep(seq_len, budget, num_sink=4):\n"
                  "    if budget < num_sink + 1:\n"
                  "        raise ValueError('budget must exceed num_sink')\n"
                  "    if budget >= seq_len:\n"
                  "        return torch.arange(seq_len)\n"
                  "    start = seq_len - (budget - num_sink) + 1  # off by one: the window is a token short\n"
                  "    return torch.cat([torch.arange(num_sink), torch.arange(start, seq_len)])\n",
                  "def streaming_keep(seq_len, budget, num_sink=4):\n"
                  "    if budget < num_sink + 1:\n"
                  "        raise ValueError('budget must exceed num_sink')\n"
                  "    return torch.cat([torch.arange(num_sink), torch.arange(seq_len - (budget - num_sink), seq_len)])"
                  "  # no budget >= seq_len case\n"],
        "right": ["def streaming_keep(seq_len, budget, num_sink=4):\n"
                  "    if budget <= num_sink:\n"
                  "        raise ValueError(f'budget {budget} must be at least num_sink + 1 = {num_sink + 1}')\n"
                  "    recent = budget - num_sink\n"
                  "    return torch.tensor([i for i in range(seq_len) if i < num_sink or i >= seq_len - recent],\n"
                  "                        dtype=torch.long)\n",
                  "def streaming_keep(seq_len, budget, num_sink=4):\n"
                  "    if budget < num_sink + 1:\n"
                  "        raise ValueError('need budget > num_sink')\n"
                  "    keep = torch.zeros(seq_len, dtype=torch.bool)\n"
                  "    keep[:num_sink] = True\n"
                  "    keep[max(0, seq_len - (budget - num_sink)):] = True\n"
                  "    return keep.nonzero().flatten()\n"],
    },
    "lab10/h2o_keep": {
        "wrong": ["def h2o_keep(attn_scores_acc, budget, recent):\n"
                  "    H, T = attn_scores_acc.shape\n"
                  "    if budget >= T:\n"
                  "        return torch.arange(T).expand(H, T).clone()\n"
                  "    heavy = attn_scores_acc.topk(budget - recent, dim=-1).indices  # over all tokens: may repeat a recent one\n"
                  "    tail = torch.arange(T - recent, T).expand(H, recent)\n"
                  "    return torch.cat([heavy, tail], dim=-1).sort(dim=-1).values\n",
                  "def h2o_keep(attn_scores_acc, budget, recent):\n"
                  "    H, T = attn_scores_acc.shape\n"
                  "    if budget >= T:\n"
                  "        return torch.arange(T).expand(H, T).clone()\n"
                  "    return attn_scores_acc.topk(budget, dim=-1).indices.sort(dim=-1).values  # no recent window\n",
                  "def h2o_keep(attn_scores_acc, budget, recent):\n"
                  "    H, T = attn_scores_acc.shape\n"
                  "    if budget >= T:\n"
                  "        return torch.arange(T).expand(H, T).clone()\n"
                  "    heavy = attn_scores_acc[:, : T - recent].topk(budget - recent, dim=-1).indices\n"
                  "    tail = torch.arange(T - recent, T).expand(H, recent)\n"
                  "    return torch.cat([heavy, tail], dim=-1)  # not sorted\n"],
        "right": ["def h2o_keep(attn_scores_acc, budget, recent):\n"
                  "    H, T = attn_scores_acc.shape\n"
                  "    n_heavy = min(budget, T) - recent if budget < T else T - recent\n"
                  "    order = attn_scores_acc[:, : T - recent].argsort(dim=-1, descending=True)  # best first\n"
                  "    keep = torch.zeros(H, T, dtype=torch.bool)\n"
                  "    keep.scatter_(1, order[:, :n_heavy], True)\n"
                  "    keep[:, T - recent:] = True\n"
                  "    return torch.stack([row.nonzero().flatten() for row in keep])\n",
                  "def h2o_keep(attn_scores_acc, budget, recent):\n"
                  "    H, T = attn_scores_acc.shape\n"
                  "    rows = []\n"
                  "    for h in range(H):\n"
                  "        s = attn_scores_acc[h].tolist()\n"
                  "        if budget >= T:\n"
                  "            rows.append(list(range(T)))\n"
                  "            continue\n"
                  "        earlier = sorted(range(T - recent), key=lambda i: -s[i])[: budget - recent]\n"
                  "        rows.append(sorted(earlier) + list(range(T - recent, T)))\n"
                  "    return torch.tensor(rows)\n"],
    },
    "lab10/snapkv_keep": {
        "wrong": [SNAPKV.replace("pooled = F.max_pool1d(votes[:, None], kernel_size, stride=1, padding=kernel_size // 2)[:, 0]",
                                 "pooled = votes  # no pooling"),
                  SNAPKV.replace("logits = logits.masked_fill(future, float('-inf'))",
                                 "pass  # no causal mask: window queries see later window keys"),
                  SNAPKV.replace("q = q_obs.view(Hkv, H // Hkv, W, D)", "q = q_obs[:: H // Hkv, None]  # first query head of each group"),
                  SNAPKV.replace("F.max_pool1d", "F.avg_pool1d")],   # average instead of max pooling
        "right": [SNAPKV, SNAPKV_LOOPS],
    },
    "lab10/pyramid_budgets": {
        "wrong": [PYRAMID.replace("(L - 1 - l) / (L - 1)", "l / (L - 1)"),  # increasing
                  "def pyramid_budgets(num_layers, total_budget, beta=20):\n"
                  "    if num_layers == 1:\n"
                  "        return [total_budget]\n"
                  "    avg = total_budget / num_layers\n"
                  "    lo, hi = avg / beta, 2 * avg - avg / beta\n"
                  "    return [round(hi - l * (hi - lo) / (num_layers - 1)) for l in range(num_layers)]  # sum drifts\n",
                  PYRAMID.replace("key=lambda l: (-(exact[l] - out[l]), l)", "key=lambda l: (-(exact[l] - out[l]), -l)")],  # ties: top first
        "right": [PYRAMID, PYRAMID_HEAP],
    },
}


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
