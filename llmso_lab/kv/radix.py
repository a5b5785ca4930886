"""Radix tree over token ids (SGLang's RadixAttention): prefix reuse at token granularity.

Each node holds the tokens on the edge into it (`key`); a path from the root spells a cached prefix.
`match_prefix` finds the longest cached prefix of a token list, token by token; `insert` adds a list and
SPLITS an edge where the new list leaves it midway, so two prompts that differ from token 37 on share 37
tokens (a hash chain of 16-token blocks shares only 32 of them).

For the engine (`kv.radix_cache.RadixBlockManager`, `prefix_caching_algo="radix"`) a node also records where its tokens' K/V
live: `blocks[j]` is the KV block of block index `start // block_size + j`. A block index that straddles a
split appears in both the parent and the child; a later branch gets its own block there (the engine copies the
parent's tokens of that block into it: copy-on-write at token granularity), so along any path the deepest
node that covers a position holds the block with every token of that path up to it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(eq=False, slots=True)
class RadixNode:
    key: list[int]                  # the tokens on the edge into this node
    start: int                      # position of key[0] in the sequence (the depth of the edge's start)
    parent: RadixNode | None = None
    children: dict[int, RadixNode] = field(default_factory=dict)   # first token of the child's key -> child
    blocks: list[int] = field(default_factory=list)                 # engine: KV blocks (see the module doc)
    last_access: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)


@dataclass(slots=True)
class RadixMatch:
    num_tokens: int             # longest cached prefix, in tokens
    node: RadixNode             # the node in which the match ends (the root when nothing matched)
    path: list[RadixNode]       # root's children down to `node`


def _common_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixTree:
    def __init__(self, block_size: int | None = None) -> None:
        self.root = RadixNode([], 0)
        self.block_size = block_size    # None: tokens only (no KV blocks recorded)
        self.clock = 0
        self.holders: dict[int, set[RadixNode]] = {}   # KV block -> the nodes that record it

    def _hold(self, node: RadixNode, blocks: list[int], hold: bool = True) -> None:
        for b in blocks:
            if hold:
                self.holders.setdefault(b, set()).add(node)
            else:
                self.holders[b].discard(node)
                if not self.holders[b]:
                    del self.holders[b]

    # ---- the tree over tokens ------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> RadixMatch:
        """Walk down from the root as far as `tokens` agree with the tree."""
        self.clock += 1
        node, pos, path = self.root, 0, []
        while pos < len(tokens) and tokens[pos] in node.children:
            child = node.children[tokens[pos]]
            n = _common_len(child.key, tokens[pos:pos + len(child.key)])
            child.last_access = self.clock
            path.append(child)
            pos += n
            node = child
            if n < len(child.key):
                break
        return RadixMatch(pos, node, path)

    def match_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` are in the tree."""
        return self.match(tokens).num_tokens

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut `node`'s edge at position `at` (node.start < at < node.end): a new parent keeps key[:at-start]."""
        k = at - node.start
        upper = RadixNode(node.key[:k], node.start, node.parent, {node.key[k]: node}, last_access=node.last_access)
        if self.block_size:
            bs = self.block_size
            first = node.start // bs
            self._hold(node, node.blocks, False)
            upper.blocks = node.blocks[:-(-at // bs) - first]      # block indices [start//bs, ceil(at/bs))
            node.blocks = node.blocks[at // bs - first:]            # block indices [at//bs, ...)
            self._hold(upper, upper.blocks)
            self._hold(node, node.blocks)
        node.parent.children[node.key[0]] = upper
        node.key, node.start, node.parent = node.key[k:], at, upper
        return upper

    def insert(self, tokens: Sequence[int], blocks: Sequence[int] | None = None) -> int:
        """Add `tokens` (with the KV `blocks` that hold them, one per block index, when the tree records blocks).
        Returns how many leading tokens were in the tree already (their existing blocks are kept)."""
        m = self.match(tokens)
        node, pos = m.node, m.num_tokens
        if pos < node.end and node is not self.root:   # the match stopped inside node's edge: split it there
            node = self._split(node, pos)
        if pos < len(tokens):
            leaf = RadixNode(list(tokens[pos:]), pos, node, last_access=self.clock)
            if self.block_size:
                assert blocks is not None, "this tree records KV blocks: pass them"
                bs = self.block_size
                leaf.blocks = list(blocks[pos // bs:-(-len(tokens) // bs)])
                self._hold(leaf, leaf.blocks)
            node.children[tokens[pos]] = leaf
        return m.num_tokens

    def nodes(self) -> list[RadixNode]:
        """Every node but the root (depth first)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def num_nodes(self) -> int:
        return len(self.nodes())

    # ---- KV blocks -----------------------------------------------------------------------------------
    def blocks_of(self, m: RadixMatch) -> list[int]:
        """For each block index the match reaches into, the block holding the path's tokens of it: the one
        recorded by the deepest node of the path that covers the block's last matched position."""
        bs, out = self.block_size, []
        for node in m.path:
            first = node.start // bs
            for j, block in enumerate(node.blocks):
                i = first + j
                if i * bs >= m.num_tokens:
                    break
                if i < len(out):
                    out[i] = block        # a deeper node covering the same block index wins
                else:
                    out.append(block)
        return out

    def evict_block(self, block: int) -> set[int]:
        """The engine reuses `block`: forget the tokens it held and everything after them on their paths
        (a later token's K/V is useless without the earlier ones). Returns every block no node records anymore."""
        bs, before = self.block_size, set(self.holders)
        while block in self.holders:
            node = next(iter(self.holders[block]))
            cut = (node.start // bs + node.blocks.index(block)) * bs   # first position stored in `block`
            if cut > node.start:        # keep the node's tokens before the block, drop the rest of its edge
                self._hold(node, node.blocks, False)
                node.key, node.blocks = node.key[:cut - node.start], node.blocks[:cut // bs - node.start // bs]
                self._hold(node, node.blocks)
                stack = list(node.children.values())
                node.children = {}
            else:
                del node.parent.children[node.key[0]]
                stack = [node]
            while stack:                # the subtree below the cut
                n = stack.pop()
                self._hold(n, n.blocks, False)
                stack.extend(n.children.values())
        return before - set(self.holders)
