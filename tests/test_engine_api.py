"""Public API of `llmso_lab.engine`: outputs, metrics, traces, stats, and clear errors on bad input."""
from __future__ import annotations

import pytest

from llmso_lab.engine import LLM, RequestOutput, SamplingParams
from llmso_lab.engine.hf_reference import hf_greedy
from llmso_lab.models import tiny_llama

MODEL = tiny_llama(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, max_position_embeddings=256)
GOOD = {"prompt_token_ids": [5, 6, 7, 8, 9]}


class CharTokenizer:
    """A stand-in tokenizer: one token per character."""
    eos_token_id = None

    def encode(self, text):
        return [ord(c) % 200 + 10 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def engine(**kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 64)
    return LLM(MODEL, **kw)


def test_generate_outputs_metrics_and_stats():
    e = engine()
    outs = e.generate([GOOD, {"prompt_token_ids": [1, 2, 3]}], [SamplingParams(max_tokens=6, ignore_eos=True),
                                                                 SamplingParams(max_tokens=3, ignore_eos=True)], use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput] * 2
    o = outs[0]
    assert o.request_id == "0" and o.prompt_token_ids == GOOD["prompt_token_ids"] and o.finished
    c = o.outputs[0]
    assert c.token_ids == hf_greedy(MODEL, GOOD["prompt_token_ids"], 6) and c.text == "" and c.finish_reason == "length"
    m = o.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert len(m.token_times) == 6 and len(m.itl) == 5 and m.tpot == pytest.approx(sum(m.itl) / 5)
    assert 0 < m.ttft <= m.e2e and m.queue_time >= 0
    s = e.stats()
    for key in ("num_preemptions_total", "prefix_cache_hit_rate", "kv_cache_usage", "kv_blocks_used", "kv_blocks_free",
                "num_generated_tokens", "throughput_tokens_per_s"):
        assert key in s
    assert s["num_generated_tokens"] == 9 and s["num_prompt_tokens"] == 8 and s["throughput_tokens_per_s"] > 0
    assert s["kv_blocks_used"] == 0 and 0 < s["kv_cache_usage_peak"] <= 1


def test_text_prompts_with_a_tokenizer():
    e = LLM(MODEL, CharTokenizer(), block_size=4, max_model_len=64)
    out = e.generate("hello", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt == "hello" and out.prompt_token_ids == CharTokenizer().encode("hello")
    assert out.outputs[0].text == CharTokenizer().decode(out.outputs[0].token_ids) and len(out.outputs[0].text) == 4


def test_add_request_step_and_trace():
    e = engine(max_num_batched_tokens=4)
    assert not e.has_unfinished_requests()
    finished, t = e.step()
    assert finished == [] and t.num_batched_tokens == 0
    rid = e.add_request(GOOD, SamplingParams(max_tokens=2, ignore_eos=True), priority=3)
    assert e.has_unfinished_requests()
    _, t = e.step()
    assert t.prefill == {rid: 4} and t.num_tokens == {rid: 4} and t.num_batched_tokens == 4
    assert t.num_blocks_used + t.num_blocks_free == e.stats()["kv_blocks_total"] and t.wall_time_s > 0
    _, t = e.step()
    assert t.prefill == {rid: 1}   # the last prompt token; its logits give the first output token
    _, t = e.step()
    assert t.decode == [rid]
    finished, t = e.step()
    assert [o.request_id for o in finished] == [rid] and t.retired == [rid] and not e.has_unfinished_requests()


def test_generate_keeps_the_outputs_of_requests_queued_before_it():
    """`generate` returns exactly its own prompts; a request queued earlier with `add_request` that finishes
    inside it is not lost: the next `step()` returns it (and `has_unfinished_requests` says it is pending)."""
    e = engine()
    early = e.add_request(GOOD, SamplingParams(max_tokens=2, ignore_eos=True))
    late = e.add_request([4, 4, 4], SamplingParams(max_tokens=40, ignore_eos=True))   # still running afterwards
    outs = e.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.request_id for o in outs] == ["2"] and len(outs[0].outputs[0].token_ids) == 6
    assert e.has_unfinished_requests()
    finished, _ = e.step()
    assert [o.request_id for o in finished] == [early]
    assert finished[0].outputs[0].token_ids == hf_greedy(MODEL, GOOD["prompt_token_ids"], 2)
    rest = []
    while e.has_unfinished_requests():
        rest += e.step()[0]
    assert [o.request_id for o in rest] == [late] and len(rest[0].outputs[0].token_ids) == 40
    assert e.step()[0] == [] and e.stats()["num_requests_finished"] == 3


def test_registry_name():
    e = LLM("tiny-llama", block_size=4, max_model_len=32)
    assert len(e.generate(GOOD, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize("make,message", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(temperature=-0.5), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(top_k=-3), "top_k"),
])
def test_bad_sampling_params(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def _bad_calls():
    long = {"prompt_token_ids": list(range(3, 73))}
    zero = SamplingParams()
    zero.max_tokens = 0            # mutated after construction: caught again at generate time
    return [
        (lambda e: e.generate({"prompt_token_ids": []}, use_tqdm=False), "prompt is empty"),
        (lambda e: e.generate([GOOD, long], use_tqdm=False), "prompt has 70 tokens but max_model_len is 64"),
        (lambda e: e.add_request(long), "prompt has 70 tokens but max_model_len is 64"),
        (lambda e: e.generate(GOOD, zero, use_tqdm=False), "max_tokens"),
        (lambda e: e.generate("text", use_tqdm=False), "tokenizer"),
        (lambda e: e.generate({"prompt_token_ids": [1, 999]}, use_tqdm=False), r"\[0, 256\)"),
        (lambda e: e.generate([GOOD, GOOD], [SamplingParams()], use_tqdm=False), "2 prompts"),
        (lambda e: e.generate([GOOD], priority=[1, 2], use_tqdm=False), "priorities"),
        (lambda e: e.add_request(GOOD, priority="high"), "priority"),
        (lambda e: e.generate(12, use_tqdm=False), "prompt"),
    ]


@pytest.mark.parametrize("call,message", _bad_calls(), ids=[m for _, m in _bad_calls()])
def test_bad_requests_raise_and_leave_the_engine_usable(call, message):
    e = engine()
    with pytest.raises(ValueError, match=message):
        call(e)
    assert not e.has_unfinished_requests(), "nothing may be queued by a rejected call"
    out = e.generate(GOOD, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(MODEL, GOOD["prompt_token_ids"], 3)


@pytest.mark.parametrize("kw,message", [
    (dict(scheduling_policy="lifo"), "valid: fcfs, priority, sjf"),
    (dict(attention_backend="cuda"), "valid: torch, triton"),
    (dict(batching="greedy"), "valid: static, dynamic, continuous"),
    (dict(preemption_mode="drop"), "valid: recompute, swap"),
    (dict(num_kv_blocks=10), "needs 16 blocks"),
    (dict(kv_cache_memory_bytes=1000), "needs 16"),
    (dict(max_model_len=10_000), "max_position_embeddings"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=32), "max_num_batched_tokens=32 < max_model_len=64"),
    (dict(block_size=0), "block_size"),
])
def test_bad_engine_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        engine(**kw)


def test_triton_backend_is_selected_through_the_hook():
    assert engine(attention_backend="triton").model_runner.backend.name == "triton"


def test_a_misspelt_engine_argument_lists_the_valid_names():
    with pytest.raises(TypeError, match=r"unknown engine argument 'max_num_seq'; valid: block_size, .*max_num_seqs"):
        engine(max_num_seq=4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_abort_request_frees_its_blocks_and_leaves_the_others_exact(mode):
    """`abort_request` (a client went away) drops a request wherever it is — running, waiting, or swapped out with
    its KV in the host pool — and gives its blocks back at once; the other requests still get HF's tokens."""
    llm = engine(num_kv_blocks=16, max_num_seqs=3, preemption_mode=mode, swap_space_blocks=16)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(20)] for i in range(3)]
    ids = [llm.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
    victim, kept, done, aborted_where = ids[1], {}, {}, None
    while llm.has_unfinished_requests():
        finished, trace = llm.step()
        done.update({o.request_id: o for o in finished})
        seqs = llm.samples.get(victim)
        if aborted_where is None and seqs and (mode == "recompute" and trace.num_running == 3 or
                                               mode == "swap" and seqs[0] in llm.scheduler.offloaded):
            aborted_where = seqs[0].status.value
            assert llm.abort_request(victim)
            llm.scheduler.check_invariants()
    assert aborted_where == ("running" if mode == "recompute" else "preempted")
    assert not llm.abort_request(victim) and not llm.abort_request("no such request")
    assert victim not in done and set(done) == {ids[0], ids[2]}
    for i in (0, 2):
        assert done[ids[i]].outputs[0].token_ids == hf_greedy(MODEL, prompts[i], 30)
    assert llm.block_manager.num_used_blocks == 0
    if mode == "swap":   # every host pool block is back
        space = llm.scheduler.preemption.space
        assert len(space.free_ids) == space.num_swap_blocks and not space.tables
