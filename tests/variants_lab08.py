"""Lab 08's exercise variants (see lab_variants.py): `wrong` ones must lose points, `right` ones keep them."""
from __future__ import annotations


VARIANTS: dict[str, dict[str, list[str]]] = {
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
}
