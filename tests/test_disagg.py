"""DisaggregatedLLM: prefill and decode engines in separate processes, KV pushed layer by layer between them.

Checked against one colocated `LLM` (same tokens, greedy and sampled), the KV byte formula (exact, per request,
with prefix-cache hits not resent), fault handling (a broken transfer frees blocks on both sides; a killed
worker fails the call naming it and leaves no process behind), the router, and bad input."""
import os
import signal
import time

import pytest
import torch

from llmso_lab.disagg import DisaggregatedLLM, RequestFailedError, kv_transfer_bytes
from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.models.tiny import tiny_llama
from llmso_lab.parallel.launcher import RankError

BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=3, seed=3)


def _prompts(lengths, seed=1, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True),
          SamplingParams(max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=7, temperature=1.0, top_k=20, ignore_eos=True)]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _alive(pids):
    return [p for p in pids if os.path.exists(f"/proc/{p}") and "Z" not in open(f"/proc/{p}/stat").read().split()[2]]


def test_outputs_bytes_prefix_cache_faults_and_kill(model):
    cfg = model.config.to_dict()
    prompts = _prompts((5, 17, 33, 40))
    ref = LLM(model, block_size=BS, enable_prefix_caching=True).generate(prompts, PARAMS, use_tqdm=False)
    d = DisaggregatedLLM(model, 1, 1, block_size=BS, enable_prefix_caching=True, cpu_affinity=[[0], [0]], timeout_s=120)
    pids = d.pids
    try:
        assert d.worker_roles == ["kv_producer", "kv_consumer"]
        assert [w["cores"] for w in d.worker_info] == [[0], [0]]
        out = d.generate(prompts, PARAMS)
        assert _tokens(out) == _tokens(ref)              # greedy and sampled: the random state travels with the KV
        recs = d.request_records()
        for o, p in zip(out, prompts):                   # every prompt token's K and V, every layer, fp32: exact
            r = recs[int(o.request_id)]
            assert r["bytes_sent"] == r["bytes_received"] == kv_transfer_bytes(cfg, len(p), 0, 4)
            assert len(r["layer_done"]) == len(r["send_spans"]) == len(r["layer_recv"]) == 3
            assert r["arrival"] <= r["prefill_start"] <= r["prefill_end"] <= r["ready"] <= r["first_token"]
        st = d.stats()
        assert st["kv_transfer_bytes"] == sum(kv_transfer_bytes(cfg, len(p), 0, 4) for p in prompts)
        assert st["ttft_queue_s"] + st["ttft_prefill_s"] + st["ttft_transfer_s"] == pytest.approx(st["ttft_s"], abs=0.05)
        # the decode worker's prefix cache: a prompt sharing 24 tokens (6 full blocks) with one it served is sent
        # without them; the output still equals the colocated engine's
        again = [prompts[3][:24] + _prompts((9,), seed=7)[0]]
        before = st["kv_transfer_bytes"]
        out2 = d.generate(again, PARAMS[0])
        ref2 = LLM(model, block_size=BS).generate(again, PARAMS[0], use_tqdm=False)
        assert _tokens(out2) == _tokens(ref2)
        assert out2[0].num_cached_tokens == 24
        assert d.stats()["kv_transfer_bytes"] - before == kv_transfer_bytes(cfg, 33, 24, 4)
        # a transfer that breaks after 1 of 3 layers fails its request with a clear error; blocks freed both sides
        d.fail_next_transfer(after_layers=1)
        with pytest.raises(RequestFailedError, match=r"request \d+ failed: prefill worker .*after 1 of 3 layers"):
            d.generate(_prompts((20, 30), seed=5), PARAMS[0])
        st = d.stats()
        assert [p["kv_blocks_used"] for p in st["prefill_pool"] + st["decode_pool"]] == [0, 0]
        assert st["decode_pool"][0]["num_incoming"] == 0
        seeded = [PARAMS[0], SamplingParams(max_tokens=9, temperature=0.8, ignore_eos=True, seed=11)]
        ref3 = LLM(model, block_size=BS).generate(prompts[:2], seeded, use_tqdm=False)
        assert _tokens(d.generate(prompts[:2], seeded)) == _tokens(ref3)   # and it keeps serving
        # a killed decode worker fails the call, naming it; every worker stops
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RankError, match=r"decode worker 0 \(rank 1\): died"):
            d.generate(prompts[:1], PARAMS[0])
    finally:
        d.shutdown()
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids)


def test_whole_cache_transfer_routing_colocated_and_two_decoders(model):
    prompts = _prompts((6, 30, 3, 25), seed=2)
    ref = LLM(model, block_size=BS).generate(prompts, PARAMS, use_tqdm=False)
    # whole-cache transfer after the prefill, prompts of <= 8 tokens prefilled by the decode worker itself
    with DisaggregatedLLM(model, 1, 2, block_size=BS, max_local_prefill_tokens=8,
                          kv_transfer_config={"kv_connector": "GlooConnector",
                                              "kv_connector_extra_config": {"layerwise": False}}) as d:
        out = d.generate(prompts, PARAMS, arrival_times=[0.0, 0.05, 0.1, 0.1])
        assert _tokens(out) == _tokens(ref)
        recs = d.request_records()
        local = [bool(recs[int(o.request_id)].get("local")) for o in out]
        assert local == [True, False, True, False]
        assert d.stats()["kv_transfer_bytes"] == sum(kv_transfer_bytes(model.config.to_dict(), n, 0, 4) for n in (30, 25))
        for o in out:   # whole-cache mode: no layer was sent before the forward ended
            r = recs[int(o.request_id)]
            if "send_spans" in r:
                assert min(s for s, _ in r["send_spans"]) >= r["prefill_end"]
    # no prefill worker: the decode worker is a colocated engine
    with DisaggregatedLLM(model, 0, 1, block_size=BS) as d:
        assert _tokens(d.generate(prompts, PARAMS)) == _tokens(ref)
        assert d.stats()["kv_transfer_bytes"] == 0


def test_bad_input_is_refused_before_any_process_starts(model):
    with pytest.raises(ValueError, match="kv_role is set per worker"):
        DisaggregatedLLM(model, kv_transfer_config={"kv_role": "kv_producer"})
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
        DisaggregatedLLM(model, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_connector 'NixlConnector' is not available"):
        DisaggregatedLLM(model, kv_transfer_config={"kv_connector": "NixlConnector"})
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config keys"):
        DisaggregatedLLM(model, kv_transfer_config={"kv_connector_extra_config": {"bandwith": 1e9}})
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0"):
        DisaggregatedLLM(model, kv_transfer_config={"kv_connector_extra_config": {"bandwidth_bytes_per_s": 0}})
    with pytest.raises(ValueError, match="cpu_affinity must give each of the 2 workers"):
        DisaggregatedLLM(model, cpu_affinity=[[0]])
    with pytest.raises(ValueError, match="num_decode_workers must be an int >= 1"):
        DisaggregatedLLM(model, 1, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size is not supported"):
        DisaggregatedLLM(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="batching='continuous'"):
        DisaggregatedLLM(model, batching="static")


def test_handoff_in_one_process_with_the_receiving_side_given():
    """`disagg.handoff.run_receiver` (Lab 09's harness): reserve on a decode engine, prefill elsewhere, hand each layer
    to the receiver, decode. With `worker.write_received_kv` every decode equals the colocated engine's tokens, a
    shared prefix is not sent (cached_tokens), blocks all come back; a receiver that ignores the block table or the
    cached prefix breaks exactly the requests that need them."""
    from llmso_lab.disagg.handoff import run_receiver
    from llmso_lab.disagg.worker import write_received_kv

    a = list(range(3, 15))
    b, c = a[:8] + list(range(100, 110)), list(range(50, 57))
    res = run_receiver(write_received_kv, [a, b], 8, sequential=True)
    assert res["equal_colocated"] == [True, True] and res["cached_tokens"] == [0, 8] and res["blocks_free_after"]
    assert res["bytes_written"] == 2 * 2 * 2 * 16 * 4 * (12 + 18 - 8)   # K+V x layers x Hkv x D x fp32 x tokens sent
    res = run_receiver(write_received_kv, [a, b, c], 6, reverse_layers=True)
    assert res["equal_colocated"] == [True] * 3 and res["cached_tokens"] == [0, 0, 0]

    def identity_blocks(caches, layer, payload, block_table, block_size, start):   # logical block = physical block
        for cache, rows in zip(caches, payload):
            cache[layer].view(-1, *cache.shape[-2:])[start:start + rows.shape[0]] = rows

    def from_zero(caches, layer, payload, block_table, block_size, start):   # overwrites the shared prefix
        write_received_kv(caches, layer, payload, block_table, block_size, 0)

    assert run_receiver(identity_blocks, [a, b, c], 6)["equal_colocated"] == [True, False, False]
    assert run_receiver(from_zero, [a, b], 8, sequential=True)["equal_colocated"] == [True, False]
