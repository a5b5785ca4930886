"""One prefill -> decode handoff in a single process, no torch.distributed: what a prefill worker exports layer by
layer and what a decode worker does with it (`worker.PrefillEngine` / `worker.DecodeEngine`, minus the threads and
the link). Tests use it, and Lab 09's exercise is graded by it (`run_receiver`): the student's receiving side
writes each layer's rows into the decode engine's reserved blocks, and the decode must then produce the colocated
engine's tokens."""
from __future__ import annotations

from dataclasses import replace

import torch

from llmso_lab.disagg.worker import DecodeEngine, Job, _caches
from llmso_lab.engine.llm import LLM
from llmso_lab.engine.sampling_params import SamplingParams

__all__ = ["export_prompt_kv", "run_receiver"]


class _Pipe:
    """Stands in for the worker's pipe to the driver: keeps what the decode engine reports."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def export_prompt_kv(llm: LLM, prompt: list[int], params: SamplingParams, start: int) -> tuple[list, int]:
    """Prefill `prompt` on `llm` (max_tokens=1) and return (per-layer payloads [2, n - start, Hkv, D] of positions
    start .. n - 1, read out of its paged cache as each layer is written, the first token)."""
    runner, bs, n = llm.model_runner, llm.config.block_size, len(prompt)
    rid = llm.add_request({"prompt_token_ids": list(prompt)}, replace(params, max_tokens=1))
    payloads: dict[int, torch.Tensor] = {}

    def hook(layer: int) -> None:   # the last prefill step rewrites every layer with the whole prompt's rows
        table = next(s for s in llm.scheduler.running if s.request_id == rid).block_table
        # the sequence's blocks in table order, flattened to positions (no slot arithmetic: the exercise's)
        payloads[layer] = torch.stack([c[layer][table].reshape(-1, *c.shape[-2:])[start:n] for c in _caches(runner)])
    runner.kv_hook = hook
    try:
        first = None
        while llm.has_unfinished_requests():
            for out in llm.step()[0]:
                first = out.outputs[0].token_ids[0]
    finally:
        runner.kv_hook = None
    return [payloads[layer] for layer in range(runner.num_layers)], first


def run_receiver(write, prompts: list[list[int]], max_tokens: int, sequential: bool = False,
                 reverse_layers: bool = False, block_size: int = 4, seed: int = 0, model=None) -> dict:
    """Lab 09's harness: disaggregated greedy decoding in one process with `write` as the decode side's receiver.

    `write(caches, layer, payload, block_table, block_size, start)` must behave like `worker.write_received_kv`:
    write one layer's K/V rows of positions start .. start + n - 1 into the paged caches through the block table.
    A prefill engine and a decode engine (prefix caching on) run a tiny seeded Llama (`models.tiny.tiny_llama`, 2
    layers, fp32; or `model`, e.g. SmolLM2 in the notebook). For each prompt the decode engine reserves blocks (sharing what its prefix cache holds: those
    tokens are not sent), the prefill engine computes the prompt and the first token, each layer's payload goes
    through `write` (`reverse_layers`: last layer first), and the request joins the decode batch. `sequential`:
    each request decodes to the end before the next one is reserved (so a later prompt that shares a prefix finds
    it cached); otherwise every request is reserved first (distinct, non-contiguous blocks) and transferred in
    reverse order. Returns plain data: "tokens" per prompt, "equal_colocated" per prompt (tokens equal one plain
    `LLM`'s), "cached_tokens" per prompt (prefix not sent), "bytes_written", "blocks_free_after"."""
    from llmso_lab.models.tiny import tiny_llama

    model = model if model is not None else tiny_llama(num_layers=2, max_position_embeddings=512, seed=seed)
    greedy = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed)
    pre = LLM(model, block_size=block_size, max_model_len=128, num_kv_blocks=64)   # colocated, then the prefill side
    colocated = [o.outputs[0].token_ids for o in pre.generate([{"prompt_token_ids": list(p)} for p in prompts], greedy,
                                                               use_tqdm=False)]
    dec = DecodeEngine(model, block_size=block_size, max_model_len=128, num_kv_blocks=64, enable_prefix_caching=True)
    pipe = _Pipe()
    dec.setup(rank=1, pipe=pipe, prefill_ranks=[])   # no receiver threads: layers are handed to accept_layer here
    jobs = [Job(i, list(p), greedy, 0.0) for i, p in enumerate(prompts)]
    tokens, cached, written = {}, {}, 0

    def transfer(job: Job) -> None:
        nonlocal written
        payloads, first = export_prompt_kv(pre, job.prompt_token_ids, greedy, cached[job.index])
        order = range(len(payloads) - 1, -1, -1) if reverse_layers else range(len(payloads))
        for layer in order:
            dec.accept_layer(job.index, layer, payloads[layer].clone(), write=write)
            written += payloads[layer].numel() * payloads[layer].element_size()
        dec.first_token(job.index, {"token": first, "prefill_start": 0.0,
                                    "generator_state": torch.Generator().manual_seed(seed).get_state()})
        dec.activate_ready(pipe)

    def reserve(job: Job) -> None:
        got = dec.reserve(job)
        if got is None:
            raise RuntimeError("the decode engine has no room for the prompt: fewer prompts or shorter ones")
        cached[job.index] = got

    def decode_all() -> None:
        for _ in range(10_000):
            if not dec.has_unfinished_requests():
                return
            for out in dec.step()[0]:
                tokens[dec.index_of.pop(out.request_id)] = list(out.outputs[0].token_ids)
        raise RuntimeError("the decode engine did not finish")

    if sequential:
        for job in jobs:
            reserve(job)
            transfer(job)
            decode_all()
    else:
        for job in jobs:
            reserve(job)
        for job in reversed(jobs):
            transfer(job)
        decode_all()
    got = [tokens[i] for i in range(len(prompts))]
    bm = dec.block_manager
    return {"tokens": got, "equal_colocated": [a == b for a, b in zip(got, colocated)],
            "cached_tokens": [cached[i] for i in range(len(prompts))], "bytes_written": written,
            "blocks_free_after": bm.num_free_blocks == bm.num_blocks}
