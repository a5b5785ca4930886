"""Model registry: the real SmolLM2 (fetched once, cached), tiny seeded models for tests, model shapes,
and KV-head conversion (MHA / GQA / MQA)."""
from llmso_lab.models.kv_heads import kv_head_counts, to_gqa, to_mha, to_mqa
from llmso_lab.models.registry import (MODELS, ModelFetchError, cache_dir, fetch_model, gguf_path, is_cached, load_model,
                                      model_dir)
from llmso_lab.models.shapes import (DEEPSEEK_V2, DEEPSEEK_V3, LLAMA2_70B, LLAMA3_8B, LLAMA3_70B, MISTRAL_7B, MODEL_SHAPES,
                                    QWEN25_7B, SMOLLM2_135M, ModelShape)
from llmso_lab.models.tiny import tiny_deepseek_v3, tiny_llama, tiny_mixtral

__all__ = ["MODELS", "ModelFetchError", "cache_dir", "fetch_model", "gguf_path", "is_cached", "load_model", "model_dir",
           "tiny_llama", "tiny_mixtral", "tiny_deepseek_v3", "ModelShape", "SMOLLM2_135M", "LLAMA3_8B", "LLAMA2_70B",
           "LLAMA3_70B", "MISTRAL_7B", "QWEN25_7B", "DEEPSEEK_V2", "DEEPSEEK_V3", "MODEL_SHAPES",
           "kv_head_counts", "to_gqa", "to_mqa", "to_mha"]
