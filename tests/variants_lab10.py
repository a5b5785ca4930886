"""Lab 10's exercise variants (see lab_variants.py): `wrong` ones must lose points, `right` ones keep them."""
from __future__ import annotations

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


POLICY = """\
class StreamingEvictionPolicy:
    def __init__(self, num_sink_blocks, window_blocks, block_size, release):
        self.sinks, self.window, self.bs, self.release = num_sink_blocks, window_blocks, block_size, release

    def cap(self, seq, n):
        if n == 0:
            return 0
        c, bs, most = seq.num_computed_tokens, self.bs, self.sinks + self.window + 1
        first_written = c // bs
        n = min(n, (max(self.sinks, first_written) + self.window + 1) * bs - c)
        held_after = -(-(c + n) // bs) - seq.num_dropped_blocks
        evictable = max(0, first_written - self.sinks - seq.num_dropped_blocks)
        k = min(evictable, max(0, held_after - most))
        for block_id in seq.block_table[self.sinks:self.sinks + k]:
            self.release(block_id)
        del seq.block_table[self.sinks:self.sinks + k]
        seq.num_dropped_blocks += k
        return n
"""
# correct but different: grow the chunk token by token, and evict one block at a time while the sequence would hold
# too many, newest-released-first order does not matter (the block manager's free list only changes block ids)
POLICY_LOOPS = """\
class StreamingEvictionPolicy:
    def __init__(self, num_sink_blocks, window_blocks, block_size, release):
        self.s, self.w, self.b, self.give_back = num_sink_blocks, window_blocks, block_size, release

    def cap(self, seq, n):
        c, b = seq.num_computed_tokens, self.b
        limit = self.s + self.w + 1
        dropped = seq.num_dropped_blocks
        last_ok = 0
        for m in range(1, n + 1):   # the most tokens that fit once the evictable blocks are gone
            spans = (c + m + b - 1) // b
            evictable = max(0, c // b - self.s - dropped)
            if spans - dropped - evictable <= limit:
                last_ok = m
            else:
                break
        n = last_ok
        gone = []
        while n and (c + n + b - 1) // b - seq.num_dropped_blocks > limit and \\
                c // b - self.s - seq.num_dropped_blocks > 0:
            gone.append(seq.block_table.pop(self.s))
            seq.num_dropped_blocks += 1
        for block_id in reversed(gone):
            self.give_back(block_id)
        return n
"""
BLEND_SEL = """\
def cacheblend_select(new, old, ratio):
    dev = (new - old).float().pow(2).sum(dim=(0, 1, 3)).sqrt() / new.float().pow(2).sum(dim=(0, 1, 3)).sqrt().clamp_min(1e-12)
    k = int(ratio * dev.numel() + 0.5)
    order = sorted(range(dev.numel()), key=lambda t: (-float(dev[t]), t))
    return torch.tensor(sorted(order[:k]), dtype=torch.long)
"""
BLEND_TOPK = """\
def cacheblend_select(new, old, ratio):
    n = new.shape[2]
    per_token = lambda x: torch.linalg.vector_norm(x.transpose(1, 2).reshape(n, -1).double(), dim=1)
    score = per_token(new - old) / per_token(new)
    count = int(ratio * n + 0.5)
    return torch.sort(torch.topk(score, count).indices).values if count else torch.zeros(0, dtype=torch.long)
"""


VARIANTS: dict[str, dict[str, list[str]]] = {
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
    "lab10/StreamingEvictionPolicy": {
        "wrong": [POLICY.replace("        n = min(n, (max(self.sinks, first_written) + self.window + 1) * bs - c)\n", ""),  # no cap
                  POLICY.replace("seq.block_table[self.sinks:self.sinks + k]", "seq.block_table[0:k]"),   # evicts the sinks
                  POLICY.replace("        seq.num_dropped_blocks += k\n", ""),    # the engine's cache index goes wrong
                  POLICY.replace("for block_id in seq.block_table[self.sinks:self.sinks + k]:\n            self.release(block_id)\n"
                                 "        del seq.block_table[self.sinks:self.sinks + k]",
                                 "end = self.sinks + evictable\n"
                                 "        for block_id in seq.block_table[end - k:end]:   # the newest evictable blocks\n"
                                 "            self.release(block_id)\n"
                                 "        del seq.block_table[end - k:end]"),
                  # no sink floor: a chunk that starts inside the sinks is capped as if it started past them
                  POLICY.replace("max(self.sinks, first_written)", "first_written")],
        "right": [POLICY, POLICY_LOOPS],
    },
    "lab10/cacheblend_select": {
        "wrong": [BLEND_SEL.replace(" / new.float().pow(2).sum(dim=(0, 1, 3)).sqrt().clamp_min(1e-12)", ""),  # absolute deviation
                  BLEND_SEL.replace("-float(dev[t])", "float(dev[t])"),                   # the least deviating tokens
                  BLEND_SEL.replace("dev = (new - old)", "dev = (new - old).abs().amax(dim=(0, 1, 3)) + 0 * (new - old)")
                  .replace(".float().pow(2).sum(dim=(0, 1, 3)).sqrt() / new", " / new").replace(
                      "dev = (new - old).abs().amax(dim=(0, 1, 3)) + 0 * (new - old) / new.float().pow(2).sum(dim=(0, 1, 3)).sqrt().clamp_min(1e-12)",
                      "dev = (new - old).abs().amax(dim=(0, 1, 3))  # max deviation of one element, not the token's norm"),
                  "def cacheblend_select(new, old, ratio):\n"
                  "    n = new.shape[2]\n"
                  "    g = torch.Generator().manual_seed(0)\n"
                  "    return torch.randperm(n, generator=g)[:int(ratio * n + 0.5)].sort().values  # random tokens\n",
                  # Python's round() rounds half to even: 24.5 tokens -> 24, not 25 (the hidden half-way cases)
                  BLEND_SEL.replace("k = int(ratio * dev.numel() + 0.5)", "k = round(ratio * dev.numel())")],
        "right": [BLEND_SEL, BLEND_TOPK],
    },
}
