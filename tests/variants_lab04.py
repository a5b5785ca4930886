"""Lab 04's exercise variants (see lab_variants.py): `wrong` ones must lose points, `right` ones keep them."""
from __future__ import annotations

# Pieces shared by several variants: a whole BlockAllocator (correct; the wrong ones edit one line of it), the
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

VARIANTS: dict[str, dict[str, list[str]]] = {
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
        "wrong": ["import bisect\n"
                  "def bounded_load_pick(ring, key, loads, c):\n"
                  "    i = bisect.bisect_left([p for p, _ in ring], key)\n"
                  "    return ring[i % len(ring)][1]  # pure prefix affinity: the key's home, however loaded\n",
                  "import bisect, math\n"
                  "def bounded_load_pick(ring, key, loads, c):\n"
                  "    i = bisect.bisect_left([p for p, _ in ring], key)\n"
                  "    cap = math.ceil(c * sum(loads) / len(loads))  # forgot the request being placed\n"
                  "    for j in range(len(ring)):\n"
                  "        r = ring[(i + j) % len(ring)][1]\n"
                  "        if loads[r] + 1 <= cap:\n"
                  "            return r\n"
                  "    return ring[i % len(ring)][1]\n",
                  "import bisect, math\n"
                  "def bounded_load_pick(ring, key, loads, c):\n"
                  "    i = bisect.bisect_right([p for p, _ in ring], key)  # a key ON a point goes to the next one\n"
                  "    cap = math.ceil(c * (sum(loads) + 1) / len(loads))\n"
                  "    for j in range(len(ring)):\n"
                  "        r = ring[(i + j) % len(ring)][1]\n"
                  "        if loads[r] + 1 <= cap:\n"
                  "            return r\n",
                  "import math\n"
                  "def bounded_load_pick(ring, key, loads, c):\n"
                  "    cap = math.ceil(c * (sum(loads) + 1) / len(loads))\n"
                  "    # the least-loaded replica under the bound: balanced, but forgets the ring (no prefix affinity)\n"
                  "    return min((r for _, r in ring if loads[r] + 1 <= cap), key=lambda r: (loads[r], r))\n"],
        "right": ["def bounded_load_pick(ring, key, loads, c):\n"
                  "    n, total = len(loads), sum(loads) + 1\n"
                  "    # linear scan for the home; integer test: load + 1 <= ceil(x)  <=>  load < x\n"
                  "    start = next((i for i, (p, _) in enumerate(ring) if p >= key), 0)\n"
                  "    order = ring[start:] + ring[:start]\n"
                  "    seen = set()\n"
                  "    for _, r in order:\n"
                  "        if r in seen:\n"
                  "            continue\n"
                  "        seen.add(r)\n"
                  "        if loads[r] < c * total / n:\n"
                  "            return r\n"],
    },
}
