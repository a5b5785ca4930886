"""The engine's inputs: prompts (text, token ids or a dict) as token ids, `generate`'s batch arguments, the model
(a registry name or a Hugging Face model) and its EOS ids as Hugging Face `generate` uses them."""
from __future__ import annotations

from llmso_lab.engine.sampling_params import SamplingParams

Prompt = str | dict | list[int]


def prompt_token_ids(prompt, tokenizer) -> tuple[list[int], str | None]:
    """(token ids, text or None) of one prompt: a string (needs `tokenizer`), a list of token ids, or
    {'prompt_token_ids': [...], 'prompt': optional text}. Raises ValueError for anything else."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass tokenizer=... or {'prompt_token_ids': [...]}")
        return list(tokenizer.encode(prompt)), prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"]), prompt.get("prompt")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return list(prompt), None
    raise ValueError("a prompt is a string, a list of token ids or {'prompt_token_ids': [...]}")


def as_batch(prompts, sampling_params) -> tuple[list, list]:
    """`generate`'s inputs as two lists: one prompt (text, token ids or a dict) becomes a list of one, and one
    SamplingParams (or None: the defaults) is repeated for every prompt. Raises ValueError for what is neither."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
    return prompts, params


def _resolve_model(model, tokenizer):
    if isinstance(model, str):
        from llmso_lab.models import load_model

        loaded, tok = load_model(model)
        return loaded, tokenizer if tokenizer is not None else tok
    if not hasattr(model, "config") or not hasattr(model, "get_input_embeddings"):
        raise ValueError(f"model must be a registry name or a Hugging Face PreTrainedModel, got {type(model).__name__}")
    return model.eval(), tokenizer


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids as Hugging Face `generate` uses them: generation_config, else config, else the tokenizer."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return frozenset([eos] if isinstance(eos, int) else eos)
    return frozenset()
