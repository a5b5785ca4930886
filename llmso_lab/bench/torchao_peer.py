"""The torchao peer of `bench quant`, run by it in the peers venv (`make setup` builds `.venv-peers`, which sees
the main venv's packages plus torchao 0.18; in the main venv transformers would import torchao at every model load).

`python -m llmso_lab.bench.torchao_peer [--quick]` prints one JSON object: for Hugging Face SmolLM2 in fp32 and with
torchao's weight-only configs applied by `torchao.quantization.quantize_` (the way torchao documents it), the
perplexity on the first `peer_ppl_tokens` of the eval text and `generate` decode tokens/s at batch 1 and 16. torchao's int8 and int4 CPU kernels
take bf16 activations, so those models run in bf16 (fp32 activations would take a slow path). A config that cannot
run on this CPU gets a row saying exactly why.
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
import warnings


def configs() -> list[tuple[str, object]]:
    """(label, function making the quantized model from an fp32 copy, or the reason it cannot run here)."""
    import torch
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    def int8(m):
        m = m.to(torch.bfloat16)
        quantize_(m, Int8WeightOnlyConfig())
        return m

    def int4_stable(m):
        m = m.to(torch.bfloat16)
        quantize_(m, Int4WeightOnlyConfig(group_size=32))
        return m

    def int4_cpu(m):
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        m = m.to(torch.bfloat16)
        quantize_(m, PrototypeInt4WeightOnlyConfig(group_size=32))
        return m

    return [("torchao int8 weight-only (Int8WeightOnlyConfig, bf16)", int8),
            ("torchao int4 g32 (Int4WeightOnlyConfig, bf16)", int4_stable),
            ("torchao int4 g32 (PrototypeInt4WeightOnlyConfig: CPU tinygemm, bf16)", int4_cpu)]


def measure(quick: bool) -> dict:
    import torch
    from llmso_lab.bench.batching import _hf_generate
    from llmso_lab.bench.quant import QUICK, FULL, chat_prompts
    from llmso_lab.models import load_model
    from llmso_lab.quality import eval_token_ids, perplexity

    cfg = QUICK if quick else FULL
    base, tok = load_model("smollm2-135m")
    # torchao's CPU kernels are slow for 512-row matmuls (see bench quant's prefill_ms): score fewer tokens, and
    # compare each quantized model with HF fp32 on the same tokens
    ids = eval_token_ids(tok, cfg["peer_ppl_tokens"])
    prompts = chat_prompts(tok, cfg["batch"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def speed(m, batch: list[list[int]]) -> float:
        runs = []
        for _ in range(cfg["repeats"]):
            ts = _hf_generate(m, batch, cfg["new_tokens"], pad)
            runs.append(len(batch) * (len(ts) - 1) / (ts[-1] - ts[0]))
        return statistics.median(runs)

    rows = []
    for label, make in [("HF fp32", lambda m: m)] + configs():
        try:
            m = make(copy.deepcopy(base))
            m(torch.tensor([prompts[0]]))   # fails here if a kernel is missing on this CPU
        except Exception as exc:  # noqa: BLE001 — the reason is the result
            rows.append({"scheme": label, "status": f"cannot run on this CPU: {type(exc).__name__}: {exc}"[:300]})
            continue
        rows.append({"scheme": label, "ppl": round(perplexity(m, ids, window=cfg["ppl_window"]), 3),
                     "b1_tok_s": round(speed(m, prompts[:1]), 1), f"b{cfg['batch']}_tok_s": round(speed(m, prompts), 1)})
        del m
    return {"torch": torch.__version__, "torchao": __import__("torchao").__version__, "ppl_tokens": len(ids), "rows": rows}


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    import logging
    logging.disable(logging.WARNING)
    print("LLMSO_PEER_JSON " + json.dumps(measure("--quick" in sys.argv)))
