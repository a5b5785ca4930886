"""Lab 09's exercise variants (see lab_variants.py): `wrong` ones must lose points, `right` ones keep them."""
from __future__ import annotations


RECV = """\
def write_received_kv(caches, layer, payload, block_table, block_size, start):
    n = payload.shape[1]
    positions = torch.arange(start, start + n)
    blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]
    slots = blocks * block_size + positions % block_size
    for cache, rows in zip(caches, payload):
        cache[layer].view(-1, *cache.shape[-2:]).index_copy_(0, slots, rows)
"""
# correct but different: token by token, through the [num_blocks, block_size] indices of the cache
RECV_LOOP = """\
def write_received_kv(caches, layer, payload, block_table, block_size, start):
    for t in range(payload.shape[1]):
        p = start + t
        block, offset = block_table[p // block_size], p % block_size
        for which, cache in enumerate(caches):
            cache[layer, block, offset] = payload[which, t]
"""


VARIANTS: dict[str, dict[str, list[str]]] = {
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
    "lab09/write_received_kv": {
        "wrong": [RECV.replace("blocks = torch.tensor(block_table, dtype=torch.long)[positions // block_size]",
                               "blocks = positions // block_size   # logical block = physical block"),
                  RECV.replace("positions = torch.arange(start, start + n)", "positions = torch.arange(n)   # ignores start"),
                  RECV.replace("for cache, rows in zip(caches, payload):", "for cache, rows in zip(caches, payload.flip(0)):  # K <-> V"),
                  RECV.replace("cache[layer].view", "cache[min(layer + 1, cache.shape[0] - 1)].view")],   # off by one layer
        "right": [RECV, RECV_LOOP],
    },
}
