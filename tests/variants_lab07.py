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


# ---- PromptLookupDrafter (graded by running the engine with the class: spec.harness.run_drafter) ----
_DRAFTER_HEAD = ("from llmso_lab.spec.drafters import Drafter\n"
                 "class PromptLookupDrafter(Drafter):\n"
                 "    def __init__(self, n_min=2, n_max=4):\n"
                 "        self.n_min, self.n_max = n_min, n_max\n"
                 "        self.first, self.indexed = {}, {}\n"
                 "    def forget(self, seq_id):\n"
                 "        self.first.pop(seq_id, None)\n"
                 "        self.indexed.pop(seq_id, None)\n")


def _scan(order: str, pad: bool = False, mutate: bool = False) -> str:
    """A stateless drafter that scans the sequence each step (`order`: the range of start positions tried)."""
    return (_DRAFTER_HEAD +
            "    def propose(self, items):\n"
            "        out = []\n"
            "        for item in items:\n"
            "            t, k, draft = list(item.seq.token_ids), item.num_lookahead, []\n"
            "            L = len(t)\n"
            "            for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):\n"
            f"                for i in {order}:\n"
            "                    if t[i:i + n] == t[L - n:]:\n"
            "                        draft = t[i + n:i + n + k]\n"
            "                        break\n"
            "                if draft:\n"
            "                    break\n"
            + ("            if draft:\n"
               "                draft = draft + [draft[-1]] * (k - len(draft))  # fill every reserved slot\n" if pad else "")
            + ("            item.seq.token_ids.extend(draft)  # 'tentatively append' the drafts\n" if mutate else "")
            + "            out.append((draft, None))\n"
            "        return out\n")


def _index(newest_only: bool = False, shared: bool = False) -> str:
    """The incremental index; `newest_only`: indexes one new n-gram end per step (as if each step added one token);
    `shared`: one index for all sequences."""
    key = "0" if shared else "item.seq.seq_id"
    ends = ("[L - 2] if sid in self.indexed else range(L - 1)" if newest_only
            else "range(max(self.indexed.get(sid, 0) - 1, 0), L - 1)")
    return (_DRAFTER_HEAD +
            "    def propose(self, items):\n"
            "        out = []\n"
            "        for item in items:\n"
            f"            sid, t = {key}, item.seq.token_ids\n"
            "            first, L = self.first.setdefault(sid, {}), len(t)\n"
            f"            for end in ({ends}):\n"
            "                for n in range(self.n_min, min(self.n_max, end + 1) + 1):\n"
            "                    first.setdefault(tuple(t[end - n + 1:end + 1]), end - n + 1)\n"
            "            self.indexed[sid] = L\n"
            "            draft = []\n"
            "            for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):\n"
            "                i = first.get(tuple(t[L - n:]))\n"
            "                if i is not None:\n"
            "                    draft = list(t[i + n:i + n + item.num_lookahead])\n"
            "                    break\n"
            "            out.append((draft, None))\n"
            "        return out\n")


_BY_LENGTH = (_DRAFTER_HEAD +   # right: per n its own dict, positions kept as lists, the first one used
              "    def propose(self, items):\n"
              "        res = []\n"
              "        for item in items:\n"
              "            s = item.seq\n"
              "            tabs = self.first.setdefault(s.seq_id, {n: {} for n in range(self.n_min, self.n_max + 1)})\n"
              "            t = s.token_ids\n"
              "            start = self.indexed.get(s.seq_id, 0)\n"
              "            for n, tab in tabs.items():\n"
              "                for i in range(max(start - n, 0), len(t) - n):\n"
              "                    tab.setdefault(tuple(t[i:i + n]), []).append(i)\n"
              "            self.indexed[s.seq_id] = len(t)\n"
              "            draft = []\n"
              "            for n in sorted(tabs, reverse=True):\n"
              "                if n >= len(t):\n"
              "                    continue\n"
              "                hits = tabs[n].get(tuple(t[-n:]))\n"
              "                if hits:\n"
              "                    draft = t[hits[0] + n:hits[0] + n + item.num_lookahead]\n"
              "                    break\n"
              "            res.append((list(draft), None))\n"
              "        return res\n")

VARIANTS["lab07/PromptLookupDrafter"] = {
    "wrong": [_scan("range(L - n - 1, -1, -1)"),   # the latest occurrence instead of the earliest
              _index(newest_only=True),            # forgets that a step can append several tokens
              _scan("range(L - n)", pad=True),     # proposes k tokens past what the match supports
              _scan("range(L - n)", mutate=True),  # writes the drafts into the sequence's tokens
              _index(shared=True)],                # one index for every sequence in the batch
    "right": [_scan("range(L - n)"),               # a scan per step instead of an index: slower, same drafts
              _BY_LENGTH],
}
