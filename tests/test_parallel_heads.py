"""Tensor parallelism splits query heads and KV heads; past the KV head count, KV heads are replicated."""
import pytest

from llmso_lab.parallel import shard_heads, valid_tp_sizes


def test_llama70b_kv_per_rank_stops_shrinking_at_tp8():
    rows = {tp: shard_heads(64, 8, tp) for tp in (1, 2, 4, 8, 16)}
    assert [rows[tp].kv_heads_per_rank for tp in rows] == [8, 4, 2, 1, 1]
    assert [rows[tp].q_heads_per_rank for tp in rows] == [64, 32, 16, 8, 4]
    assert rows[16].kv_replication == 2 and rows[8].kv_replication == 1
    assert rows[16].kv_fraction_per_rank(8) == rows[8].kv_fraction_per_rank(8) == 1 / 8


def test_smollm2_heads_allow_tp_1_3_9_only():
    assert valid_tp_sizes(9, 3) == [1, 3, 9]
    assert shard_heads(9, 3, 9) .kv_replication == 3
    with pytest.raises(ValueError, match="tensor_parallel_size=2.*valid sizes for 9 query / 3 KV heads: 1, 3, 9"):
        shard_heads(9, 3, 2)


def test_kv_replication_needs_a_multiple_of_the_kv_heads():
    with pytest.raises(ValueError, match="multiple of 8"):
        shard_heads(96, 8, 12)   # 96 query heads split over 12, but 8 KV heads cannot be replicated evenly
    with pytest.raises(ValueError, match="KV heads cannot be split"):
        shard_heads(24, 6, 4)
    with pytest.raises(ValueError, match="ints >= 1"):
        shard_heads(8, 8, 0)


def test_kv_bytes_per_rank_stops_shrinking_once_kv_heads_are_replicated():
    from llmso_lab.parallel import kv_bytes_per_rank
    assert [kv_bytes_per_rank(80, 64, 8, 128, tp) for tp in (1, 2, 4, 8, 16)] == [327_680, 163_840, 81_920, 40_960, 40_960]
    assert kv_bytes_per_rank(30, 9, 3, 64, 9, dtype_bytes=4) == kv_bytes_per_rank(30, 9, 3, 64, 3, dtype_bytes=4) == 15_360
    with pytest.raises(ValueError, match="valid sizes"):
        kv_bytes_per_rank(30, 9, 3, 64, 2)
