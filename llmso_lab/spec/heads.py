"""Draft heads that read the target's own hidden state (lecture 2-1): Medusa and EAGLE.

Both reuse the target's LM head (and EAGLE its embedding), frozen: only the small head is trained (project
scripts in `scripts/`, weights in `data/spec/`), so a head costs a few MB where a separate draft model costs
its own embedding table.

`load_draft_model` loads the project's small draft model for SmolLM2 (a separate LlamaForCausalLM with its
vocabulary, for `speculative_config={"method": "draft_model", "model": load_draft_model(), ...}`);
`save_draft_model` writes that format. `scripts/train_spec_drafts.py` trains all three.

- `MedusaHeads` (Cai et al., 2024): head i maps the final hidden state h_t (the one the LM head turns into
  token t+1) to h_t + SiLU(W_i h_t), whose logits guess token t+2+i. All k guesses come from one h_t at once:
  cheap, but head i never sees the tokens guessed before it, so acceptance falls quickly with i. (Medusa
  verifies a *tree* of several candidates per head; the engine verifies the top-1 chain.)
- `EagleHead` (Li et al., 2024): autoregression over *features*. Input at position p: fc([embed(x_p); f_{p-1}])
  (the token and the target's feature one step earlier; f_{-1} = 0), one Llama decoder layer over all
  positions (its own KV cache), then an RMSNorm: the prediction of f_p, the target's final-normed hidden state,
  whose logits give token p+1. Drafting feeds its own predicted features back in, one token at a time.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

__all__ = ["MedusaHeads", "EagleHead", "save_head", "load_head", "DEFAULT_HEADS", "DEFAULT_DRAFT",
           "save_draft_model", "load_draft_model"]

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_HEADS = {"medusa": ROOT / "data" / "spec" / "medusa_smollm2.pt", "eagle": ROOT / "data" / "spec" / "eagle_smollm2.pt"}
DEFAULT_DRAFT = ROOT / "data" / "spec" / "draft_smollm2.pt"


class MedusaHeads(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int = 4) -> None:
        super().__init__()
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.res = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for lin in self.res:   # start as the identity map: head i first guesses what the LM head says for t+1
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, h: Tensor) -> Tensor:
        """h [N, hidden] (final-normed) -> [num_heads, N, hidden]; multiply by the LM head for the logits."""
        return torch.stack([h + nn.functional.silu(lin(h)) for lin in self.res])

    def config_dict(self) -> dict:
        return {"kind": "medusa", "hidden_size": self.hidden_size, "num_heads": self.num_heads}


class EagleHead(nn.Module):
    """`fc` and a one-layer `LlamaForCausalLM` (`self.model`) whose embedding and LM head are the target's."""

    def __init__(self, target_config, intermediate_size: int | None = None) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        hidden = target_config.hidden_size
        self.intermediate_size = intermediate_size or target_config.intermediate_size
        cfg = LlamaConfig(
            vocab_size=target_config.vocab_size, hidden_size=hidden, num_hidden_layers=1,
            num_attention_heads=target_config.num_attention_heads, num_key_value_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None) or hidden // target_config.num_attention_heads,
            intermediate_size=self.intermediate_size, max_position_embeddings=target_config.max_position_embeddings,
            rms_norm_eps=target_config.rms_norm_eps, rope_theta=_rope_theta(target_config), tie_word_embeddings=True,
            attn_implementation="sdpa")
        self.fc = nn.Linear(2 * hidden, hidden)
        self.model = LlamaForCausalLM(cfg)
        self.hidden_size = hidden

    def attach(self, target: nn.Module) -> EagleHead:
        """Share the target's embedding and LM head (frozen; they are not part of the saved head)."""
        self.model.model.embed_tokens.weight = target.get_input_embeddings().weight
        self.model.lm_head.weight = target.get_output_embeddings().weight
        for p in (self.model.model.embed_tokens.weight, self.model.lm_head.weight):
            p.requires_grad_(False)
        return self

    def inputs(self, token_ids: Tensor, prev_features: Tensor) -> Tensor:
        """fc([embed(x_p); f_{p-1}]): [..., hidden] for token ids [...] and features [..., hidden]."""
        emb = self.model.model.embed_tokens(token_ids)
        return self.fc(torch.cat([emb, prev_features.to(emb.dtype)], dim=-1))

    def forward(self, token_ids: Tensor, prev_features: Tensor) -> tuple[Tensor, Tensor]:
        """token_ids [B, T], prev_features [B, T, hidden] -> (predicted features [B, T, hidden], logits [B, T, V])."""
        out = self.model.model(inputs_embeds=self.inputs(token_ids, prev_features))
        f = out.last_hidden_state                                   # after the head's RMSNorm
        return f, self.model.lm_head(f)

    def config_dict(self) -> dict:
        return {"kind": "eagle", "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size}

    def trainable_state_dict(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))


def save_head(head: nn.Module, path: str | Path, **meta) -> None:
    """Save a head's own weights in fp16 with its config and `meta` (e.g. target="smollm2-135m"); an EAGLE head
    leaves out the target's embedding and LM head, which `load_head` attaches again."""
    state = head.trainable_state_dict() if isinstance(head, EagleHead) else head.state_dict()
    torch.save({"config": {**head.config_dict(), **meta}, "state_dict": {k: v.half() for k, v in state.items()}}, path)


def load_head(kind: str, source, target: nn.Module) -> nn.Module:
    """The Medusa / EAGLE head for `target`: `source` is a head module, a path to saved weights, or None (the
    project's trained head for SmolLM2 in data/spec/). Checks it fits the target."""
    if isinstance(source, nn.Module):
        head = source
    else:
        path = Path(source) if source is not None else DEFAULT_HEADS[kind]
        if not path.exists():
            raise ValueError(f"no {kind} head at {path}: pass speculative_config['model'] = a path to trained weights "
                             f"(scripts/train_spec_drafts.py writes them) or a head module")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        cfg = saved["config"]
        if cfg.get("kind") != kind:
            raise ValueError(f"{path} holds a {cfg.get('kind')} head, not a {kind} head")
        if cfg["hidden_size"] != target.config.hidden_size:
            raise ValueError(f"{path} was trained for hidden size {cfg['hidden_size']}, the target has "
                             f"{target.config.hidden_size}: train a head for this model")
        head = (MedusaHeads(cfg["hidden_size"], cfg["num_heads"]) if kind == "medusa"
                else EagleHead(target.config, cfg["intermediate_size"]))
        missing, unexpected = head.load_state_dict({k: v.float() for k, v in saved["state_dict"].items()}, strict=False)
        missing = [k for k in missing if "embed_tokens" not in k and "lm_head" not in k]   # the target's, attached below
        if missing or unexpected:
            raise ValueError(f"{path} does not match a {kind} head: missing {missing}, unexpected {unexpected}")
    if head.hidden_size != target.config.hidden_size:
        raise ValueError(f"the {kind} head has hidden size {head.hidden_size}, the target {target.config.hidden_size}")
    if isinstance(head, EagleHead):
        head.attach(target)
    return head.eval()


def save_draft_model(model: nn.Module, path: str | Path, **meta) -> None:
    """Save a draft `LlamaForCausalLM` as {"config": its LlamaConfig as a dict, "state_dict": fp16 weights, "meta"}.
    A tied LM head is stored once (it is the embedding): half the file of a small model whose embedding dominates."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    torch.save({"config": model.config.to_dict(), "state_dict": {k: v.detach().half() for k, v in state.items()},
                "meta": meta}, path)


def load_draft_model(path: str | Path | None = None) -> nn.Module:
    """The draft model saved by `save_draft_model` (default: the project's draft for SmolLM2,
    data/spec/draft_smollm2.pt) as an fp32 `LlamaForCausalLM` in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path) if path is not None else DEFAULT_DRAFT
    if not path.exists():
        raise ValueError(f"no draft model at {path}: run `python scripts/train_spec_drafts.py draft` to train it, "
                         f"or pass the path of a file written by save_draft_model")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "config" not in saved or "state_dict" not in saved:
        raise ValueError(f"{path} is not a draft model file (expected the dict written by save_draft_model)")
    cfg = {k: v for k, v in saved["config"].items() if k not in ("architectures", "transformers_version")}
    config = LlamaConfig(**cfg)
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in saved["state_dict"].items()}, strict=False)
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]     # the embedding, tied again below
    if missing or unexpected:
        raise ValueError(f"{path} does not match its own config: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.float().eval()
