"""What a vLLM user sends, served as vLLM serves it (issue 51, faults 4, 7 and 8): `echo`, a list of prompts, chat
content parts, `max_completion_tokens`, the `developer` role, unknown fields ignored with a warning, EOS named in
the logprobs, inter-token latency per sample, and tokenization that never stalls the event loop. Each was refused
or wrong on the server of 9634bfe."""
import copy
import logging
import threading
import time

import httpx
import pytest

from llmso_lab.engine import LLM, SamplingParams
from llmso_lab.serve import running_server
from llmso_lab.serve.metrics import histogram_buckets, parse_scrape
from test_serve import ENGINE, LETTERS, ToyTokenizer, events, model, offline, server, wait_idle  # noqa: F401
from test_serve_hardening import BODY, openai_error, still_serving

GREEDY = {"temperature": 0, "ignore_eos": True}


def post(server, path, body, timeout=30):
    return httpx.post(f"{server.base_url}/v1/{path}", json=body, timeout=timeout)


# ---- 8. what a vLLM user sends -------------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_with_a_warning(server, model, caplog):
    body = {**BODY, "frobnicate": 1, "stream_options": None, "messages_extra": {"a": 1}}
    with caplog.at_level(logging.WARNING, logger="llmso_lab.serve"):
        r = post(server, "completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline(model, BODY["prompt"], max_tokens=6, **GREEDY).text
    warned = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert warned and "frobnicate" in warned[0] and "messages_extra" in warned[0]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "ab", "x_note": 1}], "max_tokens": 3, **GREEDY}
    with caplog.at_level(logging.WARNING, logger="llmso_lab.serve"):
        assert post(server, "chat/completions", chat).status_code == 200
    assert any("messages.0.x_note" in rec.getMessage() for rec in caplog.records)


def test_echo_puts_the_prompt_before_each_choice_streamed_or_not(server, model):
    for prompt, ids in (("abc", [3, 4, 5]), ([26, 27, 28], [26, 27, 28])):   # ids 26-28 read "abc" (i % 26)
        want = "abc" + offline(model, ids, max_tokens=5, **GREEDY).text
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "echo": True, "n": 2, **GREEDY}
        r = post(server, "completions", body)
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == [want, want]
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, timeout=30) as s:
            chunks = [c for e in events(s)[:-1] for c in e["choices"]]
        assert ["".join(c["text"] for c in chunks if c["index"] == i) for i in (0, 1)] == [want, want]
    openai_error(post(server, "completions", {**BODY, "echo": True, "logprobs": 1}), 400, "echo")
    still_serving(server, model)


def test_a_list_of_prompts_gets_n_choices_per_prompt_in_openais_order(server, model):
    prompts = ["abc", "hello", "xy"]
    want = [offline(model, ToyTokenizer().encode(p), max_tokens=4, **GREEDY).text for p in prompts]
    body = {"model": "tiny", "prompt": prompts, "max_tokens": 4, "n": 2, **GREEDY}
    r = post(server, "completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == list(range(6))
    assert [c["text"] for c in data["choices"]] == [w for w in want for _ in range(2)]
    assert data["usage"]["prompt_tokens"] == sum(map(len, prompts)) and data["usage"]["completion_tokens"] == 24
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=30,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        evs = events(s)
    chunks = [c for e in evs[:-1] for c in e["choices"]]
    assert ["".join(c["text"] for c in chunks if c["index"] == i) for i in range(6)] == [w for w in want for _ in range(2)]
    assert evs[-2]["usage"]["completion_tokens"] == 24 and evs[-1] == "[DONE]"
    ids = post(server, "completions", {**body, "prompt": [ToyTokenizer().encode(p) for p in prompts], "n": 1})
    assert [c["text"] for c in ids.json()["choices"]] == want
    # one bad prompt refuses the whole request and queues none of them
    openai_error(post(server, "completions", {**body, "prompt": ["ab", "a" * 600]}), 400, "max_model_len")
    openai_error(post(server, "completions", {**body, "prompt": ["a"] * 33}), 400, "prompt")
    openai_error(post(server, "completions", {**body, "prompt": []}), 400, "empty")
    still_serving(server, model)


def chat_tokens(messages):
    """What ToyTokenizer's template makes of the messages (role, then content, then the assistant's turn)."""
    return ToyTokenizer().apply_chat_template(messages)


def test_chat_content_parts_the_developer_role_and_max_completion_tokens(server, model):
    plain = {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": "ab\ncd"}], "max_tokens": 5, **GREEDY}
    want = offline(model, chat_tokens(plain["messages"]), max_tokens=5, **GREEDY).text
    parts = {**plain, "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                                   {"role": "user", "content": [{"type": "text", "text": "ab"},
                                                                {"type": "text", "text": "cd"}]}]}
    for body in (plain, parts):
        r = post(server, "chat/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
    r = post(server, "chat/completions", {**plain, "max_tokens": 9, "max_completion_tokens": 2})
    assert r.json()["usage"]["completion_tokens"] == 2
    image = {**plain, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    openai_error(post(server, "chat/completions", image), 400, "messages.0.content.0", "text")
    openai_error(post(server, "chat/completions", {**plain, "max_completion_tokens": 0}), 400)
    still_serving(server, model)


# ---- 7. EOS in the logprobs, ITL per sample ------------------------------------------------------------------------
class NamedEos(ToyTokenizer):
    """EOS is the token the model greedily emits first; skipped in text, named `</s>` when special tokens show."""

    def __init__(self, eos):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return "".join(("" if skip_special_tokens else "</s>") if i == self.eos_token_id else LETTERS[i % 26]
                       for i in ids)


def test_eos_is_named_in_the_logprobs_not_empty(model):
    first = offline(model, [3, 4, 5], max_tokens=1, **GREEDY).token_ids[0]
    model = copy.deepcopy(model)
    model.generation_config.eos_token_id = first   # the engine takes EOS from the generation config, as HF does
    with running_server(model, NamedEos(first), served_model_name="tiny", **ENGINE) as s:
        r = post(s, "completions", {"model": "tiny", "prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0,
                                    "logprobs": 2})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["text"] == ""
        assert choice["logprobs"]["tokens"] == ["</s>"] and "</s>" in choice["logprobs"]["top_logprobs"][0]


def test_inter_token_latency_is_per_sample_when_n_is_above_one(model, server):
    out = LLM(model, ToyTokenizer(), **ENGINE).generate(
        [[3, 4, 5]], SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=0, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert len(m.itl) == 3 * 5 and min(m.itl) > 0   # merged timelines gave 0 s gaps between the samples' tokens
    assert m.tpot == pytest.approx(sum(m.itl) / 15)

    def itl_count():
        buckets = histogram_buckets(parse_scrape(httpx.get(f"{server.base_url}/metrics").text),
                                    "vllm:inter_token_latency_seconds")
        return buckets[-1][1]

    before = itl_count()
    assert post(server, "completions", {**BODY, "n": 3, "temperature": 0.8, "seed": 1}).status_code == 200
    assert itl_count() - before == 3 * 5


# ---- 4. tokenizing never stalls the event loop or the engine -------------------------------------------------------
class SlowTokenizer(ToyTokenizer):
    """Takes 3 s for a long text, as a Hugging Face tokenizer does for megabytes."""

    def encode(self, text):
        if len(text) > 10_000:
            time.sleep(3)
        return super().encode(text)


def test_a_long_prompt_is_tokenized_off_the_event_loop(model):
    with running_server(model, SlowTokenizer(), served_model_name="tiny", **ENGINE) as s:
        done = {}

        def big():
            done["big"] = post(s, "completions", {**BODY, "prompt": "a" * 20_000}, timeout=60)
            done["big_at"] = time.monotonic()

        worker = threading.Thread(target=big)
        worker.start()
        time.sleep(0.5)   # the long prompt is being tokenized now
        assert httpx.get(f"{s.base_url}/health", timeout=10).status_code == 200
        r = post(s, "completions", {**BODY, "max_tokens": 8})   # tokenizes its short prompt, runs 8 engine steps
        served_at = time.monotonic()
        worker.join(timeout=60)
        assert r.status_code == 200 and "big_at" in done
        assert served_at < done["big_at"], "a short request waited for another's tokenization"
        openai_error(done["big"], 400, "max_model_len")
        wait_idle(s.llm)
