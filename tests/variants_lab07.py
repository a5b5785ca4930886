"""Lab 07's exercise variants (see lab_variants.py): `wrong` ones must lose points, `right` ones keep them."""
from __future__ import annotations


VARIANTS: dict[str, dict[str, list[str]]] = {
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
}
