"""Lab 05's exercise variants (see lab_variants.py): `wrong` ones must lose points, `right` ones keep them."""
from __future__ import annotations


VARIANTS: dict[str, dict[str, list[str]]] = {
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
                  "    return torch.einsum('hs,hsv->hv', s.softmax(-1), v)[None]\n",
                  "import torch\nimport torch.nn.functional as F\n"
                  "def mla_decode_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):\n"
                  "    # absorbed, through SDPA: one shared KV head [c_kv, k_pe] (value c_kv) for all H query heads\n"
                  "    q = torch.cat([torch.einsum('thd,hdr->thr', q_nope, w_uk), q_pe], -1).transpose(0, 1)  # [H, 1, r+dr]\n"
                  "    kv = torch.cat([c_kv, k_pe], -1)\n"
                  "    o = F.scaled_dot_product_attention(q[None], kv[None, None], c_kv[None, None], scale=scale)[0]\n"
                  "    return torch.einsum('htr,hvr->thv', o, w_uv)\n"],
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
}
