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
    "lab08/tp_mlp_forward": {
        "wrong": ["import torch\n"
                  "def tp_mlp_forward(x, gate, up, down, group):\n"
                  "    r, tp = group.rank, group.size\n"
                  "    n = gate.shape[0] // tp\n"
                  "    g = group.all_reduce(x @ gate[r * n:(r + 1) * n].t())  # all-reduce before the activation\n"
                  "    u = x @ up[r * n:(r + 1) * n].t()\n"
                  "    return (torch.nn.functional.silu(g) * u) @ down[:, r * n:(r + 1) * n].t()\n",
                  "import torch\n"
                  "def tp_mlp_forward(x, gate, up, down, group):\n"
                  "    r, tp = group.rank, group.size\n"
                  "    n = gate.shape[0] // tp\n"
                  "    h = torch.nn.functional.silu(x @ gate[r * n:(r + 1) * n].t()) * (x @ up[r * n:(r + 1) * n].t())\n"
                  "    m = down.shape[0] // tp\n"
                  "    return group.all_reduce(h @ down[r * m:(r + 1) * m].t())  # down sharded by rows, not columns\n",
                  "import torch\n"
                  "def tp_mlp_forward(x, gate, up, down, group):\n"
                  "    r, tp = group.rank, group.size\n"
                  "    n = gate.shape[0] // tp\n"
                  "    h = torch.nn.functional.silu(x @ gate[r * n:(r + 1) * n].t()) * (x @ up[r * n:(r + 1) * n].t())\n"
                  "    return h @ down[:, r * n:(r + 1) * n].t()  # forgets the all-reduce: each rank has a partial sum\n",
                  "import torch\n"
                  "def tp_mlp_forward(x, gate, up, down, group):\n"
                  "    # no sharding at all: every rank computes the whole MLP and 'all-reduces' its 1/tp of it\n"
                  "    y = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t()\n"
                  "    return group.all_reduce(y / group.size)\n"],
        "right": ["import torch\n"
                  "import torch.nn.functional as F\n"
                  "def tp_mlp_forward(x, gate, up, down, group):\n"
                  "    # gate and up fused into one column-parallel matmul, shards taken with chunk\n"
                  "    g_r = gate.chunk(group.size, dim=0)[group.rank]\n"
                  "    u_r = up.chunk(group.size, dim=0)[group.rank]\n"
                  "    d_r = down.chunk(group.size, dim=1)[group.rank]\n"
                  "    gu = F.linear(x, torch.cat([g_r, u_r]))\n"
                  "    g, u = gu.split(g_r.shape[0], dim=-1)\n"
                  "    out = F.linear(g * torch.sigmoid(g) * u, d_r)\n"
                  "    group.all_reduce(out)  # in place\n"
                  "    return out\n",
                  "import torch\n"
                  "def tp_mlp_forward(x, gate, up, down, group):\n"
                  "    # a strided partition: rank r owns features r, r + tp, r + 2 tp, ... (as Megatron-correct as\n"
                  "    # contiguous shards: each rank holds 1/tp of the weights, one all-reduce, output equal to TP = 1)\n"
                  "    idx = torch.arange(group.rank, gate.shape[0], group.size)\n"
                  "    h = torch.nn.functional.silu(x @ gate[idx].t()) * (x @ up[idx].t())\n"
                  "    return group.all_reduce(h @ down[:, idx].t())\n"],
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
    "lab08/pipeline_stage": {
        "wrong": ["def pipeline_stage(stage, num_stages, num_microbatches, inputs, compute, send, recv):\n"
                  "    # store-and-forward: collect every micro-batch first, then compute them all, then send them all\n"
                  "    xs = inputs if stage == 0 else [recv(stage - 1) for _ in range(num_microbatches)]\n"
                  "    ys = [compute(x) for x in xs]\n"
                  "    if stage == num_stages - 1:\n"
                  "        return ys\n"
                  "    for y in ys:\n"
                  "        send(y, stage + 1)\n",
                  "import torch\n"
                  "def pipeline_stage(stage, num_stages, num_microbatches, inputs, compute, send, recv):\n"
                  "    # no micro-batches: the whole batch passes as one block\n"
                  "    outs = []\n"
                  "    for j in range(num_microbatches):\n"
                  "        x = inputs[j] if stage == 0 else recv(stage - 1)\n"
                  "        outs.append(x)\n"
                  "    y = compute(torch.cat(outs))\n"
                  "    if stage == num_stages - 1:\n"
                  "        return list(y.chunk(num_microbatches))\n"
                  "    for part in y.chunk(num_microbatches):\n"
                  "        send(part, stage + 1)\n",
                  "def pipeline_stage(stage, num_stages, num_microbatches, inputs, compute, send, recv):\n"
                  "    outs = []\n"
                  "    for j in reversed(range(num_microbatches)):  # the last stage returns them in reverse order\n"
                  "        x = inputs[j] if stage == 0 else recv(stage - 1)\n"
                  "        y = compute(x)\n"
                  "        if stage < num_stages - 1:\n"
                  "            send(y, stage + 1)\n"
                  "        else:\n"
                  "            outs.append(y)\n"
                  "    return outs if stage == num_stages - 1 else None\n"],
        "right": ["def pipeline_stage(stage, num_stages, num_microbatches, inputs, compute, send, recv):\n"
                  "    # the schedule as time steps: at step t stage s works on micro-batch t - s\n"
                  "    done = {}\n"
                  "    for t in range(num_microbatches + num_stages - 1):\n"
                  "        j = t - stage\n"
                  "        if not 0 <= j < num_microbatches:\n"
                  "            continue\n"
                  "        x = recv(stage - 1) if stage > 0 else inputs[j]\n"
                  "        done[j] = compute(x)\n"
                  "        if stage + 1 < num_stages:\n"
                  "            send(done.pop(j), stage + 1)\n"
                  "    return [done[j] for j in sorted(done)] if stage == num_stages - 1 else None\n"],
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
