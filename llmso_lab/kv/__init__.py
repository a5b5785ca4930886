"""KV-cache management: the paged block manager (ref counts, free list, prefix hash chain, swap) and, in
`llmso_lab.kv.fragmentation`, the waste of contiguous vs paged allocation; StreamingLLM's block eviction rule for
the engine in `llmso_lab.kv.streaming`."""
from llmso_lab.kv.block_manager import Block, BlockManager, hash_block

__all__ = ["Block", "BlockManager", "hash_block"]
