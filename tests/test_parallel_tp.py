"""The process launcher and tensor parallelism in the engine: real ranks (spawned processes) over gloo."""
import os
import time

import pytest
import torch

import parallel_ranks
from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.engine.cache_sizing import kv_cache_bytes_per_block
from llmso_lab.models.tiny import tiny_deepseek_v3, tiny_llama
from llmso_lab.parallel.launcher import RankError, Workers, launch
from llmso_lab.parallel.tensor import (column_parallel_linear, head_slices, row_parallel_linear, run_tp_mlp, shard_linear,
                                       tp_mlp_forward)

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _gone(pids, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{p}") and "zombie" not in open(f"/proc/{p}/status").read().lower()
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


# ---- launcher ------------------------------------------------------------------------------------
def test_launch_returns_results_in_rank_order_and_leaves_no_process():
    out = launch(parallel_ranks.all_reduce_sum, 3, (10.0,))
    assert [total for total, _ in out] == [33.0, 33.0, 33.0]
    pids = [pid for _, pid in out]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert _gone(pids)


def test_a_failing_rank_fails_the_run_with_its_traceback():
    with pytest.raises(RankError, match=r"(?s)rank 1: raised:.*ValueError: rank 1 fails on purpose"):
        launch(parallel_ranks.raise_on_rank1, 2, timeout_s=30)
    with pytest.raises(RankError, match=r"rank 0: died \(exit code 7\)"):
        launch(parallel_ranks.exit_on_rank0, 2, timeout_s=30)


def test_a_hanging_rank_times_out_and_is_killed():
    w = Workers(parallel_ranks.hang, 2, timeout_s=30, _persistent=False)
    pids = [p.pid for p in w.procs]
    t0 = time.monotonic()
    with pytest.raises(RankError, match="no reply within 3 s"):
        w.recv(0, timeout_s=3)
    assert time.monotonic() - t0 < 15 and _gone(pids)
    with pytest.raises(ValueError, match="world_size"):
        launch(parallel_ranks.all_reduce_sum, 0)


# ---- sharding, single process ----------------------------------------------------------------
def test_column_and_row_parallel_linears_rebuild_the_full_output():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 12, generator=g), torch.randn(8, 12, generator=g)
    for tp in (1, 2, 4):
        cols = torch.cat([column_parallel_linear(x, w, r, tp) for r in range(tp)], dim=-1)
        rows = sum(row_parallel_linear(x[:, r * 12 // tp:(r + 1) * 12 // tp], w, r, tp) for r in range(tp))
        torch.testing.assert_close(cols, x @ w.t())
        torch.testing.assert_close(rows, x @ w.t())
    assert shard_linear(w, 1, 4, "column").shape == (2, 12) and shard_linear(w, 1, 4, "row").shape == (8, 3)
    with pytest.raises(ValueError, match="uneven"):
        shard_linear(w, 0, 3, "column")
    with pytest.raises(ValueError, match="style"):
        shard_linear(w, 0, 2, "diagonal")


def test_head_slices_split_then_replicate_kv_heads():
    assert [head_slices(9, 3, r, 3) for r in range(3)] == [(range(3 * r, 3 * r + 3), range(r, r + 1)) for r in range(3)]
    # TP 9 > 3 KV heads: each rank one query head; ranks 0-2 share KV head 0 (replicated 3 times)
    assert [head_slices(9, 3, r, 9)[1] for r in range(9)] == [range(r // 3, r // 3 + 1) for r in range(9)]
    assert head_slices(4, 2, 3, 4) == (range(3, 4), range(1, 2))
    with pytest.raises(ValueError, match="valid sizes for 9 query / 3 KV heads: 1, 3, 9"):
        head_slices(9, 3, 0, 2)


# ---- the engine ----------------------------------------------------------------------------
def test_engine_tp_equals_tp1_counts_all_reduces_sizes_kv_per_rank_and_fails_cleanly():
    model = tiny_llama(num_layers=3, num_heads=4, num_kv_heads=2)
    prompts = [[5, 6, 7, 8, 9], [10, 20, 30], list(range(40, 90))]
    one = LLM(model, kv_cache_memory_bytes=1 << 20, max_model_len=256, block_size=8)
    ref = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    for tp in (4, 2):   # 4 > 2 KV heads: each KV head replicated twice
        llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory_bytes=1 << 20, max_model_len=256, block_size=8)
        pids = [p.pid for p in llm.model_runner.workers.procs]
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        stats = llm.stats()
        assert out == ref, f"tp={tp}"
        assert stats["tp_all_reduces_per_rank"] == 2 * 3 * stats["tp_num_forwards"] > 0
        assert len(stats["tp_all_reduce_s_per_rank"]) == tp
        if tp == 2:   # the same per-rank budget holds twice the blocks: each rank caches 1 of the 2 KV heads
            per_rank, whole = (kv_cache_bytes_per_block(model.config, 8, torch.float32, t) for t in (2, 1))
            assert whole == 2 * per_rank and llm.block_manager.num_blocks == (1 << 20) // per_rank
            assert one.block_manager.num_blocks == (1 << 20) // whole
            assert [info[1]["kv_heads"] for info in llm.model_runner.rank_info] == [1, 1]
            procs = llm.model_runner.workers.procs   # a rank killed mid-service fails the next request clearly
            procs[1].kill()
            procs[1].join(5)
            with pytest.raises(RankError, match="rank 1: (died|cannot send)"):
                llm.generate([[1, 2, 3]], GREEDY)
        else:
            assert [info[1]["kv_heads"] for info in llm.model_runner.rank_info] == [1] * 4
            llm.shutdown()
        assert _gone(pids), f"tp={tp}: rank processes left behind"


def test_engine_tp_refuses_what_cannot_split():
    model = tiny_llama(num_layers=2, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3.*valid sizes for 4 query / 2 KV heads: 1, 2, 4"):
        LLM(model, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="not MLA"):
        LLM(tiny_deepseek_v3(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config with tensor_parallel_size"):
        LLM(model, tensor_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LLM(model, tensor_parallel_size=0)


def test_one_mlp_sharded_by_torch_tensor_parallel_equals_ours():
    """Peer: torch.distributed.tensor.parallel (DTensor ColwiseParallel / RowwiseParallel) runs on gloo here."""
    mlp = tiny_llama(num_layers=1, hidden_size=64).model.layers[0].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = mlp(x)
    for ours, theirs in launch(parallel_ranks.dtensor_mlp, 2, (mlp, x)):
        torch.testing.assert_close(ours, full, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(theirs, full, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_smollm2_tp3_greedy_tokens_equal_tp1_or_diverge_only_at_a_near_tie():
    """SmolLM2 (9 query / 3 KV heads) at TP 3: the all-reduce sums three partials in another order than one matmul,
    so logits differ in the last bits. Greedy tokens must match; where they do not, TP 1's top-2 logit gap at the
    first divergence must be a near-tie (< 1e-3), which is then reported, not hidden."""
    from llmso_lab.models import load_model

    model, tok = load_model("smollm2-135m")
    prompts = ["The capital of France is", "def fibonacci(n):", "List three prime numbers:"]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(model, tok, max_model_len=128).generate(prompts, greedy)]
    with LLM(model, tok, max_model_len=128, tensor_parallel_size=3) as llm:
        three = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert llm.stats()["tp_all_reduces_per_rank"] == 60 * llm.stats()["tp_num_forwards"]
    for prompt, a, b in zip(prompts, one, three):
        if a == b:
            continue
        pos = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        ids = torch.tensor([tok.encode(prompt) + a[:pos]])
        with torch.no_grad():
            top2 = model(ids).logits[0, -1].float().topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < 1e-3, f"{prompt!r}: TP 3 diverged at token {pos} where TP 1's top-2 gap is {gap:.3g} (not a near-tie)"
        print(f"near-tie: {prompt!r} diverges at token {pos}, top-2 gap {gap:.2e}")


# ---- the TP MLP exercise's harness: a function from anywhere, run in forked ranks ---------------------------------
def test_run_tp_mlp_checks_output_all_reduces_and_each_ranks_share():
    for tp in (1, 2, 3):
        assert run_tp_mlp(tp_mlp_forward, tp, seed=tp) | {"max_abs_diff": 0} == {
            "output_equals_tp1": True, "ranks_agree": True, "all_reduces_per_rank": [1] * tp,
            "partial_is_rank_share": True, "max_abs_diff": 0}

    def no_all_reduce(x, gate, up, down, group):   # defined here: only a forked rank can run it
        n = gate.shape[0] // group.size
        cols = slice(group.rank * n, (group.rank + 1) * n)
        return (torch.nn.functional.silu(x @ gate[cols].t()) * (x @ up[cols].t())) @ down[:, cols].t()

    def whole_mlp_over_tp(x, gate, up, down, group):   # right output, but no rank computes only its share
        return group.all_reduce((torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ down.t() / group.size)

    r = run_tp_mlp(no_all_reduce, 2)
    assert not r["output_equals_tp1"] and r["all_reduces_per_rank"] == [0, 0] and r["max_abs_diff"] > 0.1
    r = run_tp_mlp(whole_mlp_over_tp, 2)
    assert r["output_equals_tp1"] and not r["partial_is_rank_share"]
    with pytest.raises(RankError, match="shapes cannot be multiplied"):
        run_tp_mlp(lambda x, gate, up, down, group: x @ gate[:3], 2)
    with pytest.raises(ValueError, match="does not split"):
        run_tp_mlp(tp_mlp_forward, 5)
    with pytest.raises(ValueError, match="start_method"):
        launch(parallel_ranks.all_reduce_sum, 2, (1.0,), start_method="forkserver")
