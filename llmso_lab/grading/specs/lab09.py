"""Lab 09 (prefill-decode disaggregation) exercises and their public checks.

References: `llmso_lab.disagg.worker:write_received_kv` (the decode side of a layer-wise KV transfer: one layer's rows
written into the reserved blocks through the block table; graded by running a prefill -> decode handoff with it,
`disagg.handoff.run_receiver`, whose decode must equal the colocated engine's tokens),
`llmso_lab.disagg.transfer:kv_transfer_bytes` (the KV bytes a prefill worker sends for one request),
`llmso_lab.disagg.transfer:exposed_transfer_time` (how much of the transfer the decode side waits for, layer-wise
or whole), `llmso_lab.sim.disagg:best_pd_ratio` (prefill : decode instances) and `llmso_lab.disagg.router:pd_route`
(remote or local prefill, and to which worker): plain numbers, lists and config dicts.
"""
from llmso_lab.grading.compare import close, exact
from llmso_lab.grading.registry import Case, Exercise, register
from llmso_lab.grading.specs.lab00 import KV_BYTES_ELSEWHERE
from llmso_lab.grading.specs.lab05 import DEEPSEEK_V3, LLAMA3_70B, SMOLLM2

# Seconds: float rounding only, and an exact 0 may come back as ~1e-19 from a different summation order.
seconds = close(atol=1e-12, rtol=1e-9)
# The other library functions that compute KV bytes from a config (Lab 05's exercise and its helpers).
KV_CONFIG_CODE = ("llmso_lab.hardware:kv_cache_bytes_of_config", "llmso_lab.hardware:kv_bytes_per_token",
                  *KV_BYTES_ELSEWHERE)

# Hugging Face config dicts beyond Lab 05's (the keys `model.config.to_dict()` has).
LLAMA2_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096}   # MHA: no num_key_value_heads
GEMMA2_9B = {"num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 3584,
             "head_dim": 256}   # head_dim 256, not 3584 / 16 = 224
QWEN3_4B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 2560,
            "head_dim": 128}   # head_dim 128, not 2560 / 32 = 80

MS = 1e-3
WORKER = "llmso_lab.disagg.worker"
A12 = list(range(3, 15))                       # prompts (token ids) for the handoff harness
B18 = A12[:8] + list(range(100, 110))          # shares its first 8 tokens (2 blocks of 4) with A12
C7 = list(range(50, 57))
P40 = [(11 * i + 5) % 250 + 3 for i in range(40)]

register(
    Exercise("kv_transfer_bytes", "09", 10, "llmso_lab.disagg.transfer:kv_transfer_bytes", [
        Case("SmolLM2-135M, 1000-token prompt: 2 x 30 layers x 3 KV heads x 64 (576 / 9) x 2 B = 23,040 B per token",
             (SMOLLM2, 1000)),
        Case("Llama-3-70B, one token: 2 x 80 x 8 KV heads x 128 x 2 B = 327,680 B", (LLAMA3_70B, 1)),
        Case("Llama-2-7B (MHA: no num_key_value_heads, so 32 KV heads), 512 tokens", (LLAMA2_7B, 512)),
        Case("Gemma-2-9B-like: head_dim 256 is given and differs from hidden_size / heads (224), 100 tokens",
             (GEMMA2_9B, 100)),
        Case("Qwen3-4B-like: head_dim 128 where hidden_size / heads is 80, 64 tokens", (QWEN3_4B, 64), hidden=True),
        Case("DeepSeek-V3 (MLA): 61 layers x (512 latent + 64 RoPE key) x 2 B per token, no factor 2, 4096 tokens",
             (DEEPSEEK_V3, 4096)),
        Case("Llama-3-70B, 8192-token prompt of which the decode worker caches 6144: only 2048 tokens travel",
             (LLAMA3_70B, 8192, 6144)),
        Case("the whole prompt is cached on the decode side: nothing to send", (SMOLLM2, 300, 300)),
        Case("SmolLM2 in fp32 (dtype_bytes=4), 256 tokens, 56 cached", (SMOLLM2, 256), {"num_cached_tokens": 56,
                                                                                       "dtype_bytes": 4}),
        Case("Llama-3-70B with an fp8 KV cache (dtype_bytes=1), 1000 tokens", (LLAMA3_70B, 1000), {"dtype_bytes": 1}),
        Case("more cached tokens than the prompt has (301 of 300): ValueError", (SMOLLM2, 300, 301),
             raises="ValueError"),
        Case("a negative number of cached tokens: ValueError", (SMOLLM2, 300, -1), raises="ValueError"),
    ], compare=exact(), tripwires=KV_CONFIG_CODE,
        description="KV bytes of the prompt tokens the decode worker does not hold yet, for an HF config "
                    "(MHA/GQA/MQA: 2 x layers x kv_heads x head_dim; MLA: layers x (kv_lora_rank + qk_rope_head_dim))"),
    Exercise("exposed_transfer_time", "09", 15, "llmso_lab.disagg.transfer:exposed_transfer_time", [
        Case("4 layers of 1 ms, each layer's KV takes 0.5 ms: the link keeps up, only the last layer's transfer "
             "is exposed", ([MS] * 4, [0.5 * MS] * 4)),
        Case("4 layers of 1 ms, 2 ms per layer on the link: a backlog builds up (the link is busy from 1 ms to 9 ms)",
             ([MS] * 4, [2 * MS] * 4)),
        Case("uneven layers: a slow transfer in the middle delays the ones after it",
             ([MS, MS, 0.2 * MS, 0.2 * MS], [0.5 * MS, 2 * MS, MS, 0.3 * MS])),
        Case("a slow transfer early, fast layers after it: the backlog from layer 3 decides, not the first or the last",
             ([MS, MS, MS, 0.1 * MS, 0.1 * MS, 0.1 * MS], [0.2 * MS, 0.2 * MS, 3 * MS, 0.5 * MS, 0.5 * MS, 0.2 * MS]),
             hidden=True),
        Case("layerwise=False: the whole cache is sent after the last layer, so every transfer is exposed",
             ([MS] * 4, [0.5 * MS] * 4), {"layerwise": False}),
        Case("one layer: its transfer starts when the prefill ends, layer-wise or not", ([3 * MS], [MS])),
        Case("nothing to send (the prompt is cached): 0 s", ([MS] * 3, [0.0] * 3)),
    ], compare=seconds, tripwires=("llmso_lab.disagg.transfer:transfer_timeline",),
        description="seconds the decode worker waits after the prefill's last layer for the rest of the KV "
                    "(one link, one layer at a time, in layer order)"),
    Exercise("best_pd_ratio", "09", 10, "llmso_lab.sim.disagg:best_pd_ratio", [
        Case("the lecture's long prompts: 8 instances, input 4000 / output 100, prefill 20,000 tok/s, "
             "decode 2,000 tok/s (5 vs 20 requests/s per instance)", (8, 4000, 100, 20000.0, 2000.0)),
        Case("the lecture's long answers: 32 instances, input 200 / output 2000, prefill 8,000 tok/s, "
             "decode 4,000 tok/s (40 vs 2 requests/s per instance)", (32, 200, 2000, 8000.0, 4000.0)),
        Case("a tie: 5 instances, both pools 8 requests/s per instance; (2, 3) and (3, 2) both serve 16, "
             "the fewest prefill instances win", (5, 1024, 128, 8192.0, 1024.0)),
        Case("2 instances: one per pool, whatever the rates", (2, 100, 1000, 50000.0, 500.0)),
        Case("10 instances, lengths alone would say 1 : 1 (input = output = 500), but prefill is 9x faster",
             (10, 500, 500, 9000.0, 1000.0)),
        Case("1 instance cannot hold both pools: ValueError", (1, 100, 100, 1000.0, 1000.0), raises="ValueError"),
    ], compare=exact(), tripwires=("llmso_lab.sim.disagg:pd_capacity",),
        description="(prefill, decode) instances out of a total that serve the most requests per second: "
                    "min(x * prefill_tok_s / input_len, y * decode_tok_s / output_len); fewest prefill on a tie"),
    Exercise("pd_route", "09", 25, "llmso_lab.disagg.router:pd_route", [
        Case("a 100-token prompt, local limit 256: prefilled by the decode worker itself (-1)",
             (100, 0, [0, 500]), {"max_local_prefill_tokens": 256}),
        Case("a 4000-token prompt: remote, to the prefill worker with the fewest queued tokens",
             (4000, 0, [3000, 1000, 2000]), {"max_local_prefill_tokens": 256}),
        Case("workers 1 and 2 tie for the fewest queued tokens: the lowest index wins",
             (4000, 0, [2000, 500, 500]), {"max_local_prefill_tokens": 256}),
        Case("a 4000-token prompt with 3900 tokens cached on the decode side: 100 new tokens, local",
             (4000, 3900, [0]), {"max_local_prefill_tokens": 256}),
        Case("exactly max_local_prefill_tokens new tokens: still local (remote only above the limit)",
             (1256, 1000, [0, 0]), {"max_local_prefill_tokens": 256}),
        Case("every prefill worker has >= 4096 tokens queued (the limit): local instead of waiting",
             (4000, 0, [5000, 4096]), {"max_local_prefill_tokens": 256, "max_prefill_queue_tokens": 4096}),
        Case("the least-loaded worker is under the queue limit: remote to it",
             (4000, 0, [5000, 4095]), {"max_local_prefill_tokens": 256, "max_prefill_queue_tokens": 4096}),
        Case("no prefill workers: local", (4000, 0, [])),
        Case("defaults (local limit 0): any uncached token goes remote", (10, 9, [7, 3])),
    ], compare=exact(),
        description="the prefill worker for a request (least-loaded, lowest index on ties) or -1 (local) when the "
                    "uncached tokens are few or every prefill queue is full"),
    Exercise("write_received_kv", "09", 40, f"{WORKER}:write_received_kv", [
        Case("three prompts reserved at once (each in its own, non-contiguous blocks), transferred last first: every "
             "decode equals the colocated engine's tokens", ([A12, B18, C7], 10)),
        Case("a prompt sharing 8 tokens with an earlier one: the decode side's prefix cache holds 2 blocks, only "
             "positions 8.. arrive (start = 8) and the cached blocks stay untouched", ([A12, B18], 8, True)),
        Case("layers arrive last first: each layer's rows go to that layer's cache", ([A12, C7], 6, False, True)),
        Case("block size 16, one 40-token prompt (3 blocks, the last one partly filled)", ([P40], 6, False, False, 16)),
        Case("a one-token prompt and a 7-token one", ([[7], C7], 5)),
    ], compare=exact(), harness="llmso_lab.disagg.handoff:run_receiver", timeout_s=120,
        tripwires=(f"{WORKER}:slots_of", f"{WORKER}:DecodeEngine._receive",
                   # the engine's own slot mapping and K/V store (the engine runs in the grader, not in the job)
                   "llmso_lab.engine.model_runner:BatchBuilder.prepare_rows", "llmso_lab.engine.kv_cache:LayerKV.write",
                   "llmso_lab.engine.attention:TorchAttentionBackend.store_kvcache", "llmso_lab.kv.quant:QuantizedPagedKV.write"),
        description="the receiving side of a layer-wise KV transfer: one layer's K/V rows of positions start.. "
                    "written into the decode engine's reserved blocks through the block table; graded by running "
                    "prefill -> decode handoffs whose decodes must equal the colocated engine's tokens"),
)
