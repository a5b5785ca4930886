"""Lab 00 (roofline) exercises and their public checks. References: `llmso_lab.hardware`."""
from llmso_lab.grading.compare import close
from llmso_lab.grading.registry import Case, Exercise, register

H100_BF16, H100_BW = 989e12, 3.35e12
rel = close(atol=0.0, rtol=1e-9)  # closed-form arithmetic: only float rounding is allowed
# The same KV-per-token formula lives in these places too; they are disabled with the exercise's reference.
KV_BYTES_ELSEWHERE = ("llmso_lab.hardware:kv_cache_bytes", "llmso_lab.hardware:mla_kv_bytes_per_token",
                      "llmso_lab.hardware:mla_kv_cache_bytes",
                      "llmso_lab.models.shapes:ModelShape.kv_bytes_per_token",
                      "llmso_lab.models.shapes:ModelShape.kv_cache_bytes",
                      "llmso_lab.sim.cost:StepCost.kv_bytes_per_token",
                      "llmso_lab.engine.cache_sizing:kv_cache_bytes_per_block")

register(
    Exercise("matmul_arithmetic_intensity", "00", 20, "llmso_lab.hardware:matmul_arithmetic_intensity", [
        Case("square 4096 matmul in bf16", (4096, 4096, 4096), {"bytes_per_elem": 2}),
        Case("decode GEMV: 1 token x [4096, 4096] weight", (1, 4096, 4096), {"bytes_per_elem": 2}),
        Case("fp32, non-square (m=3, n=5, k=7)", (3, 5, 7), {"bytes_per_elem": 4}),
    ], compare=rel, tripwires=("llmso_lab.hardware:matmul_flops",),   # the numerator: half the answer
        description="FLOPs per byte of an [m,k] @ [k,n] matmul"),
    Exercise("roofline_time", "00", 10, "llmso_lab.hardware:roofline_time", [
        Case("memory-bound: 140 GB of weights on an H100", (2 * 70e9, 140e9, H100_BF16, H100_BW)),
        Case("compute-bound: 1 PFLOP, 1 GB", (1e15, 1e9, H100_BF16, H100_BW)),
    ], compare=rel, tripwires=("llmso_lab.hardware:attainable_flops", "llmso_lab.sim.cost:StepCost.time_of"),
        description="max(compute time, memory time)"),
    Exercise("compute_bound_tokens", "00", 20, "llmso_lab.hardware:compute_bound_tokens", [
        Case("Llama-3-70B in fp16 on an H100", (140e9, 140e9, H100_BF16, H100_BW)),
        Case("SmolLM2-135M in fp32 on a 200 GFLOP/s, 25 GB/s CPU", (538e6, 269e6, 200e9, 25e9)),
    ], compare=rel, tripwires=("llmso_lab.hardware:ridge_point",),   # the roofline's ridge is this answer's core
        description="new tokens per forward at which the math takes as long as reading the weights"),
    Exercise("kv_bytes_per_token", "00", 15, "llmso_lab.hardware:kv_bytes_per_token", [
        Case("the lecture's 70B: 80 layers, 8 KV heads, head_dim 128, fp16", (80, 8, 128), {"bytes_per_elem": 2}),
        Case("SmolLM2-135M in fp32: 30 layers, 3 KV heads, head_dim 64", (30, 3, 64), {"bytes_per_elem": 4}),
    ], compare=rel, tripwires=KV_BYTES_ELSEWHERE, description="KV-cache bytes added per token"),
    Exercise("decode_tokens_per_s_bound", "00", 20, "llmso_lab.hardware:decode_tokens_per_s_bound", [
        Case("70B fp16 on an H100, batch 1", (140e9, H100_BW)),
        Case("batch 8 with 4K context each", (140e9, H100_BW), {"batch": 8, "context_len": 4096,
                                                               "kv_bytes_per_token": 327680}),
    ], compare=rel, tripwires=("llmso_lab.hardware:decode_bytes_per_step",),
        description="memory-bound ceiling on generated tokens/s"),
    Exercise("precision_speedup", "00", 15, "llmso_lab.hardware:precision_speedup", [
        Case("SmolLM2 batch-1 decode, fp32 -> bf16 on a CPU with 10x bf16 matmuls", (1, 134.5e6, 4, 2, 0.28e12, 2.8e12, 25e9)),
        Case("SmolLM2 prefill of 256 tokens, fp32 -> bf16, same CPU", (256, 134.5e6, 4, 2, 0.28e12, 2.8e12, 25e9)),
        Case("70B on an H100, fp16 -> int4 weights (W4A16), batch-64 decode", (64, 70e9, 2, 0.5, H100_BF16, H100_BF16, H100_BW)),
    ], compare=rel, tripwires=("llmso_lab.hardware:roofline_time", "llmso_lab.hardware:attainable_flops",
                               "llmso_lab.sim.cost:StepCost.time_of"),
        description="roofline speed-up of a forward when the weights change precision"),
)
