"""Hidden checks for Lab 04 (instructor only; not in the student bundle): edge lengths, fork trees, radix splits."""
from llmso_lab.grading.registry import Case, hidden
from llmso_lab.grading.specs.lab04 import FREE, REFS, W, X, Y, Z, _chat, call, ring_edge_keys, zipf_keys

_many = [(p, o) for p, o in zip(range(1, 40, 3), range(37, 1, -3))]   # 13 requests of assorted lengths

hidden("04", {
    "kv_waste": [
        (([(5, 3)], "paged"), {"moment": "lifetime", "block_size": 1}),                 # block size 1: no waste at all
        (([(1, 1)], "contiguous_max_len"), {"moment": "lifetime", "max_model_len": 2}),  # one state of one token
        (([(7, 1), (1, 7)], "paged"), {"moment": "lifetime", "block_size": 8}),          # output 1: only the prompt state
        ((_many, "paged"), {"moment": "lifetime", "block_size": 16}),
        ((_many, "paged"), {"moment": "at_finish", "block_size": 256}),                   # blocks larger than any sequence
        ((_many, "contiguous_max_tokens"), {"moment": "at_finish", "max_tokens": 40}),
        ((_chat, "contiguous_max_tokens"), {"moment": "lifetime", "max_tokens": 1024}),
        ((_chat, "paged"), {"moment": "lifetime", "block_size": 16}),
        ((_chat, "contiguous_max_len"), {"moment": "at_finish", "max_model_len": 2048}),
    ],
    "BlockAllocator": [
        Case("three samples of one prompt, each writes its own last block", (16, 4), calls=[
            call("allocate", 0, 10), call("fork", 0, 1), call("fork", 0, 2), call(REFS, 0), call("append", 1),
            call("append", 2), call("append", 0), call(REFS, 0), call(REFS, 1), call(REFS, 2), call(FREE)]),
        Case("fork of a fork (beam search): ref counts add up, copies happen once per writer", (12, 2), calls=[
            call("allocate", "a", 5), call("fork", "a", "b"), call("fork", "b", "c"), call(REFS, "c"),
            call("append", "c", 3), call(REFS, "a"), call(REFS, "c"), call("free", "a"), call(REFS, "b"),
            call("append", "b"), call(REFS, "b"), call(FREE)]),
        Case("a full last block is never copied: the writer gets a new block", (8, 4), calls=[
            call("allocate", "p", 8), call("fork", "p", "c"), call("append", "c"), call("append", "p"),
            call(REFS, "p"), call(REFS, "c"), call(FREE)]),
        Case("a long append copies the shared block once and grows the table", (20, 4), calls=[
            call("allocate", "p", 6), call("fork", "p", "c"), call("append", "c", 11), call(REFS, "c"),
            call(REFS, "p"), call(FREE), call("free", "p"), call(FREE), call("free", "c"), call(FREE)]),
        Case("the copy itself needs a free block: MemoryError when there is none", (3, 4), calls=[
            call("allocate", "p", 10), call("fork", "p", "c"), call("append", "c"), call(FREE), call(REFS, "c"),
            call("free", "p"), call("append", "c"), call(REFS, "c"), call(FREE)]),
        Case("block size 1: every token its own block, nothing ever shared to write into", (10, 1), calls=[
            call("allocate", "x", 3), call("fork", "x", "y"), call("append", "y", 2), call(REFS, "x"), call(REFS, "y"),
            call(FREE), call("allocate", "z", 3), call("allocate", "w", 1), call(FREE)]),
        Case("freeing everything returns every block, in any order", (9, 4), calls=[
            call("allocate", 1, 4), call("fork", 1, 2), call("fork", 2, 3), call("append", 3, 5), call("allocate", 4, 9),
            call("free", 2), call("free", 4), call("free", 1), call(FREE), call("free", 3), call(FREE)]),
        Case("a sequence id can be used again after it is freed", (6, 4), calls=[
            call("allocate", "s", 5), call("free", "s"), call("allocate", "s", 17), call(REFS, "s"), call(FREE)]),
    ],
    "prefix_cache_hits": [
        (([[7]], 4), {}),                                                  # shorter than a block: no key, no hit
        (([X, X, X + [1]], 4), {}),                                        # one block cached: the last token is computed
        (([X + Y + Z + W, X + Y + Z + W + [1], X + Y + [0]], 4), {}),      # a prompt extends another
        (([X + Y + [0], Z + W + [0], X + W + [0]], 4), {}),                # W after Z is cached, W after X is not
        (([[3, 1, 4, 1, 5], [3, 1, 4, 1, 6], [3, 1, 2]], 1), {}),          # block size 1: token granularity
        (([Y + Y + Y + Y + [0], Y + Y + [0], Y + Y + Y + [0]], 4), {}),    # the same block over and over
        (([list(range(40)), list(range(40)), list(range(20)) + list(range(20))], 8), {}),
    ],
    "RadixTree": [
        Case("empty lists", (), calls=[call("insert", []), call("match_prefix", []), call("num_nodes"),
                                       call("insert", [3]), call("match_prefix", []), call("num_nodes")]),
        Case("repeated tokens", (), calls=[call("insert", [1, 1, 1, 1]), call("insert", [1, 1, 2]),
                                           call("match_prefix", [1, 1, 1, 1, 1]), call("num_nodes"),
                                           call("match_prefix", [1, 2]), call("insert", [1]), call("num_nodes")]),
        Case("a split inside a second-level edge", (), calls=[
            call("insert", X + Y + Z), call("insert", X + W), call("insert", X + Y + [5, 6, 0]), call("num_nodes"),
            call("match_prefix", X + Y + [5, 6, 0, 1]), call("match_prefix", X + [13, 14, 0]), call("insert", X + Y + Z + W),
            call("num_nodes")]),
        Case("an agent tree: a task, 3 calls, 3 calls each", (), calls=[
            *[call("insert", [9, 9, 9, 9, 9] + [a] * 3 + [a, b] * 2) for a in (1, 2, 3) for b in (4, 5, 6)],
            call("num_nodes"), call("match_prefix", [9, 9, 9, 9, 9, 2, 2, 2, 2, 5, 2, 0]),
            call("insert", [9, 9, 9]), call("num_nodes")]),
        Case("an insert returns what was there before it", (), calls=[
            call("insert", [4, 4, 5]), call("insert", [4, 4, 5, 6]), call("insert", [4, 7]), call("insert", [4, 4, 5, 6]),
            call("insert", [4, 4, 5, 7, 7]), call("num_nodes"), call("match_prefix", [4, 4, 5, 7, 8])]),
        Case("many prompts sharing a long head", (), calls=[
            *[call("insert", list(range(40)) + [100 + i] * (i % 3 + 1)) for i in range(6)], call("num_nodes"),
            call("match_prefix", list(range(40)) + [101, 0]), call("match_prefix", list(range(39)) + [7])]),
    ],
    "bounded_load_pick": [
        ((1, zipf_keys(30, 5, 11), 1.25, 10), {}),          # one replica takes everything
        ((8, zipf_keys(300, 30, 12), 1.25, 64), {}),        # a bigger cluster, long-lived requests
        ((8, zipf_keys(300, 30, 13), 2.0, 64), {}),         # c = 2: more affinity, higher peaks
        ((3, zipf_keys(90, 3, 14), 1.0, 30), {}),           # three prefixes on three replicas, c = 1
        ((4, [7] * 60, 1.25, 40), {}),                      # one hot key: everything overflows along the ring
        ((5, ring_edge_keys(5), 1.1, 6), {}),               # ring edges again, another ring
        ((6, zipf_keys(200, 4, 15), 1.5, 1000), {}),        # nobody leaves: loads only grow
    ],
})
