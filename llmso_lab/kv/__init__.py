"""KV-cache management: the paged block manager (ref counts, free list, prefix hash chain, swap)."""
from llmso_lab.kv.block_manager import Block, BlockManager, hash_block

__all__ = ["Block", "BlockManager", "hash_block"]
