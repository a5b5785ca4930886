"""Train the learned drafters for speculative decoding on SmolLM2-135M (lecture 2-1).

    python scripts/train_spec_drafts.py data     # prompts -> data/spec/train_prompts.json, SmolLM2's greedy answers
    python scripts/train_spec_drafts.py draft    # a small separate draft model   -> data/spec/draft_smollm2.pt
    python scripts/train_spec_drafts.py medusa   # 4 Medusa heads                  -> data/spec/medusa_smollm2.pt
    python scripts/train_spec_drafts.py eagle    # an EAGLE head                   -> data/spec/eagle_smollm2.pt
    python scripts/train_spec_drafts.py all      # all of the above, in that order

The defaults are the settings of the committed weights (data/spec/README.md has the results and the trials).

Every drafter learns to guess what SmolLM2 itself would say, so the training text is SmolLM2's own greedy
output on ~300 chat prompts (sequence-level distillation: for greedy decoding, the greedy tokens are exactly
what verification accepts). The last 10% of the prompts are held out; the evaluation there measures top-1
agreement with SmolLM2, step by step, the way drafting uses each drafter:

- a draft of length k made when the sequence ends at token x_s guesses x_{s+1}, ..., x_{s+k};
- `acc[j]`: how often guess j is right when guesses 1..j-1 were right (so its context is the true one);
- `chain[j]`: how often guesses 1..j are all right = P(at least j drafts accepted), and
  `tokens_per_step` = 1 + sum_j chain[j]: tokens one verification step emits with k drafts (greedy).

Runs on a CPU (2 threads, bf16 autocast where the CPU multiplies bf16 natively). The functions that train take
their model and data as arguments, so tests run them on tiny models (tests/test_spec_heads.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmso_lab.spec.heads import EagleHead, MedusaHeads, load_draft_model, save_draft_model, save_head  # noqa: E402

SPEC_DIR = ROOT / "data" / "spec"
PROMPTS_PATH = SPEC_DIR / "train_prompts.json"
GENERATIONS_PATH = SPEC_DIR / "train_generations.pt"
DRAFT_PATH = SPEC_DIR / "draft_smollm2.pt"
MEDUSA_PATH = SPEC_DIR / "medusa_smollm2.pt"
EAGLE_PATH = SPEC_DIR / "eagle_smollm2.pt"
REPORT_PATH = SPEC_DIR / "train_report.json"
CALIB_PATH = ROOT / "data" / "eval" / "calib_text.txt"   # passages for the copy tasks (never eval_text*.txt)
TARGET = "smollm2-135m"
HELDOUT_FRAC = 0.1
K = 4                       # draft steps evaluated (and Medusa heads)
MAX_TOKENS = 192            # generation length

Generation = tuple[list[int], list[int]]   # (prompt token ids, SmolLM2's greedy output ids)


# ============================================================================================ prompts
TOPICS = [
    "volcanoes", "photosynthesis", "the moon", "honey bees", "bicycles", "rainbows", "the internet", "sourdough bread",
    "black holes", "the water cycle", "earthquakes", "the Roman Empire", "chess", "recycling", "electric cars",
    "the human heart", "coral reefs", "solar panels", "the printing press", "penguins", "clouds", "vaccines",
    "the stock market", "jazz music", "the Great Wall of China", "tides", "compound interest", "dinosaurs",
    "the immune system", "coffee", "the Olympic Games", "glaciers", "democracy", "the periodic table", "owls",
    "rain forests", "bread yeast", "lighthouses", "public libraries", "wind turbines", "the solar system",
    "sleep", "friendship", "trains", "the Amazon river", "origami", "mushrooms", "computer passwords",
    "maps and compasses", "the violin",
]
FREE_TEMPLATES = {
    "question": ["What do you know about {t}?", "Can you tell me about {t}?", "What should a beginner know about {t}?",
                 "What makes {t} interesting?", "What are some common misconceptions about {t}?"],
    "explain": ["Explain {t} to a ten-year-old.", "Explain {t} in two short paragraphs.",
                "Give a simple explanation of {t} with one example.", "How would you describe {t} to a friend?"],
    "story": ["Write a short story about {t}.", "Write a short poem about {t}.",
              "Tell me a bedtime story that involves {t}.", "Write a short diary entry by someone who loves {t}."],
    "list": ["List five facts about {t}.", "Give me three questions a student might ask about {t}, with answers.",
             "Write three tips for learning about {t}.", "What are the pros and cons of {t}?"],
}
HOWTO_TASKS = [
    "make a cup of tea", "plant tomatoes", "fix a flat bicycle tyre", "write a cover letter", "study for an exam",
    "bake banana bread", "start running", "save money each month", "learn a new language", "clean a laptop keyboard",
    "make a paper airplane", "prepare for a job interview", "keep a houseplant alive", "write a thank-you note",
    "organise a small party", "boil an egg", "reduce screen time", "pack for a weekend trip", "make a simple budget",
    "improve my handwriting", "brew coffee without a machine", "start a vegetable garden", "write a short speech",
    "fall asleep faster", "teach a dog to sit", "make a smoothie", "back up my phone", "learn to juggle",
    "read more books", "plan a picnic",
]
HOWTO_TEMPLATES = ["How do I {t}?", "Give me step-by-step instructions to {t}.", "What is the easiest way to {t}?"]
SUMMARISE = ["Summarise the following passage in two sentences.\n\n{p}", "Give a one-sentence summary of this text:\n\n{p}",
             "Summarise this passage for a beginner:\n\n{p}", "What is the main idea of the following text?\n\n{p}"]
QUOTE = ["Quote the first sentence of the following passage exactly.\n\n{p}",
         "Repeat the following text word for word.\n\n{p}",
         "Copy the last sentence of this passage exactly as it is written:\n\n{p}",
         "Which sentence of this passage mentions \"{w}\"? Quote it exactly.\n\n{p}"]
REWRITE = ["Rewrite the following passage in simpler words.\n\n{p}",
           "Rewrite this text as a bulleted list of its main points:\n\n{p}",
           "Correct the spelling mistakes in the following text and return it in full.\n\n{p}",
           "Rewrite the following passage so that it is friendlier and easier to read.\n\n{p}"]
PASSAGE_QA = ["Using only the text below, explain what it says about \"{w}\".\n\n{p}",
              "Read the context and answer the question.\n\nContext: {p}\n\n"
              "Question: What does the context say about \"{w}\"?"]


def calib_passages(text: str, min_chars: int = 150, max_chars: int = 750) -> list[str]:
    """Paragraphs of the calibration text (headings dropped), short ones joined to the next while the result
    stays under `max_chars`: passages of roughly 40-200 tokens."""
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) >= 80]
    out, cur = [], ""
    for p in paras:
        if cur and len(cur) + 1 + len(p) > max_chars:     # p would make it too long: close the passage first
            out.append(cur)
            cur = ""
        cur = f"{cur} {p}" if cur else p
        if len(cur) >= min_chars:
            out.append(cur)
            cur = ""
    return out + ([cur] if cur else [])


def key_term(passage: str, rng: random.Random) -> str:
    """A term the passage quotes or emphasises ("global", *scope*), else one of its longest words."""
    terms = re.findall(r'"([^"\s][^"]{0,30})"', passage) + re.findall(r"\*([A-Za-z][^*]{0,30})\*", passage)
    if not terms:
        terms = sorted(set(re.findall(r"[A-Za-z]{9,}", passage)))
    return rng.choice(terms)


def add_typos(text: str, rng: random.Random, n: int = 4) -> str:
    """Swap two inner letters in `n` words of 6+ letters (a text to correct, mostly copied)."""
    words = text.split(" ")
    long = [i for i, w in enumerate(words) if len(w) >= 6 and w.isalpha()]
    for i in rng.sample(long, min(n, len(long))):
        w, j = words[i], rng.randrange(1, len(words[i]) - 2)
        words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


FIRST = ["Ana", "Ben", "Chloe", "David", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Lucas"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Toronto", "Krakow", "Perth", "Dublin", "Porto"]
ITEMS = ["apples", "pencils", "notebooks", "batteries", "mugs", "lamps", "towels", "candles"]


def json_task(rng: random.Random) -> str:
    """A small JSON document and one edit to make: the answer copies most of the document."""
    kind = rng.choice(["person", "inventory", "config"])
    if kind == "person":
        doc = {"name": rng.choice(FIRST), "age": rng.randint(18, 80), "city": rng.choice(CITIES),
               "email": f"user{rng.randint(1, 999)}@example.com", "active": rng.choice([True, False])}
        edits = [f'Change "city" to "{rng.choice(CITIES)}"',
                 f'Add a key "phone" with the value "555-{rng.randint(1000, 9999)}"',
                 'Remove the "email" key', f'Set "age" to {rng.randint(18, 80)}', 'Rename the key "name" to "full_name"']
    elif kind == "inventory":
        doc = {"store": f"{rng.choice(CITIES)} branch",
               "items": [{"name": it, "count": rng.randint(0, 50)} for it in rng.sample(ITEMS, 3)]}
        edits = [f'Add an item "{rng.choice(ITEMS)}" with count {rng.randint(1, 20)}', "Set every count to 0",
                 f'Change the store to "{rng.choice(CITIES)} branch"', "Remove the last item"]
    else:
        doc = {"version": f"1.{rng.randint(0, 9)}.{rng.randint(0, 9)}", "debug": rng.choice([True, False]),
               "max_users": rng.choice([10, 50, 100, 500]), "theme": rng.choice(["dark", "light"]),
               "languages": rng.sample(["en", "fr", "de", "es", "pt", "ja"], 3)}
        edits = ['Turn "debug" off', 'Add "it" to "languages"', f'Set "max_users" to {rng.choice([20, 200, 1000])}',
                 'Change "theme" to "solarized"']
    return (f"Here is a JSON document:\n\n{json.dumps(doc, indent=2)}\n\n{rng.choice(edits)}. "
            "Return the full updated JSON.")


def fact_sheet_task(rng: random.Random) -> str:
    """A made-up fact sheet and a question whose answer is copied from it."""
    shop = f"{rng.choice(FIRST)}'s {rng.choice(['Bakery', 'Bookshop', 'Bike Repair', 'Cafe', 'Hardware Store'])}"
    open_h, close_h = rng.randint(6, 10), rng.randint(17, 21)
    facts = {"Name": shop, "Address": f"{rng.randint(1, 200)} {rng.choice(['Mill', 'River', 'Oak', 'Harbour'])} Street, "
             f"{rng.choice(CITIES)}", "Opening hours": f"Monday to Saturday, {open_h}:00 to {close_h}:00; closed on Sunday",
             "Phone": f"+1 555 {rng.randint(100, 999)} {rng.randint(1000, 9999)}",
             "Owner": f"{rng.choice(FIRST)} {rng.choice(['Silva', 'Berg', 'Okafor', 'Tanaka', 'Novak', 'Murphy'])}",
             "Founded": str(rng.randint(1950, 2020))}
    question = rng.choice(["When does the shop open and close?", "What is the address?", "Who owns the shop?",
                           "Is the shop open on Sunday?", "What phone number can I call?", "When was it founded?"])
    sheet = "\n".join(f"{k}: {v}" for k, v in facts.items())
    return f"Answer the question using the fact sheet.\n\n{sheet}\n\nQuestion: {question}"


def build_prompts(calib_text: str, seed: int = 0) -> list[dict]:
    """~300 training prompts, deterministic for a seed: free chat (questions, explanations, stories, lists over
    50 topics; how-tos) and copy-heavy tasks (summarise / quote / rewrite a passage of the calibration text,
    edit a JSON document, answer from a context). Shuffled, so the last 10% (held out) mixes every kind."""
    rng = random.Random(seed)
    prompts: list[dict] = []

    def add(kind: str, text: str) -> None:
        prompts.append({"kind": kind, "messages": [{"role": "user", "content": text}]})

    kinds = list(FREE_TEMPLATES)
    for i, topic in enumerate(TOPICS):                      # 150 free-chat prompts: 3 kinds per topic
        for j in range(3):
            kind = kinds[(i + j) % len(kinds)]
            templates = FREE_TEMPLATES[kind]
            add(kind, templates[(i // len(kinds) + j) % len(templates)].format(t=topic))
    for i, task in enumerate(HOWTO_TASKS):                  # 30 how-tos
        add("howto", HOWTO_TEMPLATES[i % len(HOWTO_TEMPLATES)].format(t=task))
    passages = calib_passages(calib_text)
    for kind, templates, n in (("summarise", SUMMARISE, 24), ("quote", QUOTE, 20), ("rewrite", REWRITE, 24),
                               ("context_qa", PASSAGE_QA, 12)):
        for i in range(n):
            p = passages[(i * 7 + len(kind)) % len(passages)]
            template = templates[i % len(templates)]
            if "spelling" in template:
                p = add_typos(p, rng)
            add(kind, template.format(p=p, w=key_term(p, rng)))
    for _ in range(14):
        add("context_qa", fact_sheet_task(rng))
    for _ in range(26):
        add("json_edit", json_task(rng))
    rng.shuffle(prompts)
    return prompts


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """SmolLM2-Instruct's chat template with the assistant turn opened, as token ids."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids     # transformers 5 may return a BatchEncoding
    return [int(t) for t in ids]


def generate(llm, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[Generation]:
    """The engine's greedy outputs for each prompt: [(prompt ids, output ids)] in prompt order."""
    from llmso_lab.engine import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], SamplingParams(max_tokens=max_tokens, temperature=0))
    return [(list(p), list(o.outputs[0].token_ids)) for p, o in zip(prompt_ids, outs)]


def split_heldout(gens: Sequence[Generation], frac: float = HELDOUT_FRAC) -> tuple[list[Generation], list[Generation]]:
    """(train, held out): the last `frac` of the generations (i.e. of the prompts) are held out."""
    n_held = max(1, round(len(gens) * frac))
    return list(gens[:-n_held]), list(gens[-n_held:])


# ============================================================================================ training loop
@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)   # one per step
    steps: int = 0
    seconds: float = 0.0
    stopped_early: bool = False                          # hit max_seconds before `steps`

    def summary(self, tail: int = 20) -> dict:
        head, last = self.losses[:tail], self.losses[-tail:]
        return {"steps": self.steps, "seconds": round(self.seconds, 1), "stopped_early": self.stopped_early,
                "loss_first": round(sum(head) / max(len(head), 1), 4), "loss_last": round(sum(last) / max(len(last), 1), 4)}


def lr_factor(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then a cosine from 1 down to 0.1 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_loop(groups: list[dict], step_loss: Callable[[int], Tensor], steps: int, warmup: int = 20,
               max_seconds: float | None = None, bf16: bool = False, log_every: int = 0, name: str = "",
               before_step: Callable[[int], None] | None = None) -> TrainResult:
    """AdamW (no weight decay) over the parameter `groups` ({"params": [...], "lr": ...}) for `steps` steps:
    `step_loss(step)` returns the loss of that step's batch (run under bf16 autocast when `bf16`). Stops early
    once `max_seconds` have passed (a time budget), and says so in the result. Parameters whose gradient is
    None (frozen for now, see `before_step`) are skipped by AdamW."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    warmup = min(warmup, steps // 10)
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    base = [g["lr"] for g in opt.param_groups]
    result, t0 = TrainResult(), time.perf_counter()
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        for g, lr in zip(opt.param_groups, base):
            g["lr"] = lr * lr_factor(step, steps, warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = step_loss(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.losses.append(loss.item())
        result.steps = step + 1
        elapsed = time.perf_counter() - t0
        if log_every and (step + 1) % log_every == 0:
            recent = result.losses[-log_every:]
            print(f"  [{name}] step {step + 1}/{steps}  loss {sum(recent) / len(recent):.4f}  {elapsed:.0f} s", flush=True)
        if max_seconds is not None and elapsed > max_seconds and step + 1 < steps:
            result.stopped_early = True
            print(f"  [{name}] time budget of {max_seconds:.0f} s reached after {step + 1} steps", flush=True)
            break
    result.seconds = time.perf_counter() - t0
    return result


def epoch_batches(lengths: Sequence[int], batch_size: int, gen: torch.Generator) -> list[list[int]]:
    """One epoch of batches of indices: shuffled, then sorted by length inside windows of 8 batches (less
    padding), then the batches shuffled again."""
    perm = torch.randperm(len(lengths), generator=gen).tolist()
    batches = []
    window = 8 * batch_size
    for w in range(0, len(perm), window):
        chunk = sorted(perm[w:w + window], key=lambda i: lengths[i])
        batches += [chunk[b:b + batch_size] for b in range(0, len(chunk), batch_size)]
    order = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in order]


def batch_stream(lengths: Sequence[int], batch_size: int, seed: int) -> Callable[[int], list[int]]:
    """step -> the indices of that step's batch, epoch after epoch (seeded)."""
    gen, queue = torch.Generator().manual_seed(seed), []

    def at(step: int) -> list[int]:
        while not queue:
            queue.extend(epoch_batches(lengths, batch_size, gen))
        return queue.pop(0)
    return at


# ============================================================================================ evaluation
def chain_metrics(correct: Tensor) -> dict:
    """correct [N, k] (bool): row n says which of the k guesses made from draft start n are right, each
    given the true tokens before it. acc[j] = mean of column j; chain[j] = P(guesses 1..j all right)
    = P(at least j drafts accepted); tokens_per_step = 1 + sum_j chain[j] (greedy verification)."""
    c = correct.to(torch.int64)
    chain = c.cumprod(dim=1).double().mean(0)
    return {"starts": int(c.shape[0]), "acc": [round(float(a), 4) for a in c.double().mean(0)],
            "chain": [round(float(a), 4) for a in chain], "tokens_per_step": round(1 + float(chain.sum()), 4)}


def draft_starts(prompt_len: int, seq_len: int, k: int) -> range:
    """Positions s of the last token when drafting happens: after the first output token (s >= P), with all k
    guessed tokens x_{s+1..s+k} inside the sequence."""
    return range(prompt_len, seq_len - k)


# ============================================================================================ draft model
def draft_config(vocab_size: int = 49152, hidden_size: int = 128, num_layers: int = 6, intermediate_size: int = 512,
                 head_dim: int = 64, num_kv_heads: int = 1, max_position_embeddings: int = 8192,
                 rope_theta: float = 100000.0):
    """A small Llama config with SmolLM2's vocabulary and positions (RoPE: no position table to store), a
    tied LM head, heads of SmolLM2's head_dim 64 and one shared K/V head (a small KV cache)."""
    from transformers import LlamaConfig
    if hidden_size % head_dim:
        raise ValueError(f"hidden_size {hidden_size} must be a multiple of head_dim {head_dim}")
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                       num_attention_heads=hidden_size // head_dim, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                       intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
                       rope_theta=rope_theta, rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02,
                       bos_token_id=1, eos_token_id=2, pad_token_id=2, attn_implementation="sdpa")


def make_draft_model(config, embedding: Tensor | None = None, seed: int = 0) -> nn.Module:
    """A random `LlamaForCausalLM(config)` (seeded; the caller's RNG is untouched) whose tied embedding starts
    from `embedding` (e.g. `pca_embedding(SmolLM2's embedding, hidden)`: similar tokens start close)."""
    from transformers import LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if embedding is not None:
        with torch.no_grad():
            model.get_input_embeddings().weight.copy_(embedding)
    return model


def draft_embedding(teacher_embedding: Tensor, dim: int, std: float = 0.2, whiten: bool = True) -> Tensor:
    """[V, dim]: `distill.pca_embedding` of the teacher's embedding, each component rescaled to standard
    deviation `std` (`whiten`). Unwhitened, SmolLM2's first principal component has ~8x the spread of the 128th:
    every token then looks alike to a small model (its first direction dominates, after the RMSNorm too),
    and the draft learns only the unigram distribution (measured: 4.8% held-out agreement, loss stuck at ~7)."""
    from llmso_lab.quant.distill import pca_embedding
    emb = pca_embedding(teacher_embedding, dim, std)
    return emb * (std / emb.std(0, keepdim=True)) if whiten else emb


def num_params(model: nn.Module) -> int:
    """Parameters counted once (a tied LM head is the embedding)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def pad_generations(gens: Sequence[Generation], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """(ids [B, L], targets [B, L]), right-padded: targets[b, t] = x_{t+1} where x_{t+1} is an output token,
    else -100 (prompt tokens are context only; padding sits after every real token, so a causal model never
    sees it)."""
    length = max(len(p) + len(o) for p, o in gens)
    ids = torch.full((len(gens), length), pad_id, dtype=torch.long)
    targets = torch.full((len(gens), length), -100, dtype=torch.long)
    for b, (p, o) in enumerate(gens):
        seq = torch.tensor(p + o)
        ids[b, :len(seq)] = seq
        targets[b, len(p) - 1:len(seq) - 1] = seq[len(p):]
    return ids, targets


def draft_loss(model: nn.Module, ids: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross-entropy at the positions with a target; the LM head (the big matmul) runs there only."""
    h = model.model(input_ids=ids).last_hidden_state
    sel = targets >= 0
    return F.cross_entropy(model.lm_head(h[sel]).float(), targets[sel])


def train_draft(model: nn.Module, gens: Sequence[Generation], steps: int, batch_size: int = 16, lr: float = 3e-3,
                embed_lr: float = 3e-4, unfreeze_at: float | None = None, seed: int = 0, bf16: bool = False,
                max_seconds: float | None = None, log_every: int = 0,
                on_unfreeze: Callable[[], None] | None = None) -> TrainResult:
    """Sequence-level distillation: `draft_loss` on batches of `gens`. The tied embedding stays frozen until
    `unfreeze_at` (a fraction of `steps`; None: always), then trains at `embed_lr` (a frozen embedding spends
    no time on the V x H weight gradient; the rare tokens would hardly learn anyway). `on_unfreeze()` runs just
    before (e.g. a held-out evaluation: what unfreezing adds)."""
    emb = model.get_input_embeddings().weight
    body = [p for p in model.parameters() if p is not emb]
    emb.requires_grad_(False)
    start = steps if unfreeze_at is None else int(unfreeze_at * steps)
    lengths = [len(p) + len(o) for p, o in gens]
    batch_at = batch_stream(lengths, batch_size, seed)
    model.train()

    def step_loss(step: int) -> Tensor:
        ids, targets = pad_generations([gens[i] for i in batch_at(step)])
        return draft_loss(model, ids, targets)

    def before_step(step: int) -> None:
        if step == start:
            if on_unfreeze is not None and step > 0:
                on_unfreeze()
                model.train()
            emb.requires_grad_(True)

    result = train_loop([{"params": body, "lr": lr}, {"params": [emb], "lr": embed_lr}], step_loss, steps,
                        max_seconds=max_seconds, bf16=bf16, log_every=log_every, name="draft", before_step=before_step)
    emb.requires_grad_(False)
    model.eval()
    return result


@torch.no_grad()
def eval_draft(model: nn.Module, gens: Sequence[Generation], k: int = K) -> dict:
    """Teacher-forced top-1 agreement with the target's greedy tokens. With the true context, guess j from
    start s is the model's next-token guess at position s+j-1, so `chain_metrics` gives the exact draft
    acceptance; `next_token_acc` is over every output token."""
    model.eval()
    rows, hits, total = [], 0, 0
    for p, o in gens:
        seq = torch.tensor(p + o)
        ok = model(seq[None]).logits[0, :-1].argmax(-1) == seq[1:]       # ok[t]: x_{t+1} guessed at t
        hits, total = hits + int(ok[len(p) - 1:].sum()), total + len(o)
        rows += [ok[s:s + k] for s in draft_starts(len(p), len(seq), k)]
    return {"next_token_acc": round(hits / max(total, 1), 4), **chain_metrics(torch.stack(rows))}


# ============================================================================================ target features
@torch.no_grad()
def target_features(target: nn.Module, gens: Sequence[Generation], bf16: bool = False, log_every: int = 0) -> list[Tensor]:
    """The target's final-normed hidden states f_t ([L, hidden] fp16 per sequence; the LM head turns f_t into
    the logits of token t+1), one frozen forward per sequence. fp16 halves the memory of fp32."""
    target.eval()
    feats, t0 = [], time.perf_counter()
    for i, (p, o) in enumerate(gens):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            h = target.model(input_ids=torch.tensor([p + o])).last_hidden_state[0]
        feats.append(h.float().half())
        if log_every and (i + 1) % log_every == 0:
            print(f"  [features] {i + 1}/{len(gens)} sequences  {time.perf_counter() - t0:.0f} s", flush=True)
    return feats


# ============================================================================================ Medusa
def medusa_examples(gens: Sequence[Generation], feats: Sequence[Tensor], k: int = K,
                    outputs_only: bool = True) -> tuple[Tensor, Tensor]:
    """(h [N, hidden] fp16, targets [N, k]): f_t and the tokens x_{t+2+i} head i must guess (-100 past the
    end). Rows: every position t (`outputs_only=False`), or those where drafting happens, t >= P-1 (f_{P-1}
    made the first output token)."""
    hs, ts = [], []
    for (p, o), f in zip(gens, feats):
        seq, n = torch.tensor(p + o), len(p) + len(o)
        first = len(p) - 1 if outputs_only else 0
        t = torch.arange(first, n - 2)                                   # head 0 needs x_{t+2}
        idx = t[:, None] + 2 + torch.arange(k)                           # [rows, k]
        ts.append(torch.where(idx < n, seq[idx.clamp(max=n - 1)], -100))
        hs.append(f[t])
    return torch.cat(hs), torch.cat(ts)


def medusa_loss(heads: MedusaHeads, lm_head: Tensor, h: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of every head's guess (logits = head(h) @ lm_head^T, the target's frozen LM head)."""
    out = heads(h.to(heads.res[0].weight.dtype))                         # [k, N, hidden]
    logits = F.linear(out.flatten(0, 1), lm_head).float()                # [k * N, V]
    return F.cross_entropy(logits, targets.T.flatten(), ignore_index=-100)


def train_medusa(heads: MedusaHeads, lm_head: Tensor, h: Tensor, targets: Tensor, steps: int, batch_size: int = 256,
                 lr: float = 1e-3, seed: int = 0, bf16: bool = False, max_seconds: float | None = None,
                 log_every: int = 0) -> TrainResult:
    """Train the heads on random batches of (f_t, tokens t+2..t+1+k) rows; `lm_head` [V, hidden] stays frozen."""
    gen = torch.Generator().manual_seed(seed)
    heads.train()

    def step_loss(step: int) -> Tensor:    # (all the rows when they fit in one batch)
        idx = torch.randint(0, h.shape[0], (batch_size,), generator=gen) if batch_size < h.shape[0] else slice(None)
        return medusa_loss(heads, lm_head, h[idx].float(), targets[idx])

    result = train_loop([{"params": list(heads.parameters()), "lr": lr}], step_loss, steps, max_seconds=max_seconds,
                        bf16=bf16, log_every=log_every, name="medusa")
    heads.eval()
    return result


@torch.no_grad()
def eval_medusa(heads: MedusaHeads, lm_head: Tensor, gens: Sequence[Generation], feats: Sequence[Tensor],
                k: int = K) -> dict:
    """Draft start s (last token x_s) uses f_{s-1}, the state that produced x_s: head i guesses x_{s+1+i}."""
    heads.eval()
    rows = []
    for (p, o), f in zip(gens, feats):
        seq = torch.tensor(p + o)
        starts = torch.tensor(list(draft_starts(len(p), len(seq), k)))
        if len(starts) == 0:
            continue
        guess = F.linear(heads(f[starts - 1].float())[:k], lm_head.float()).argmax(-1).T      # [starts, k]
        rows.append(guess == seq[starts[:, None] + 1 + torch.arange(k)])
    return chain_metrics(torch.cat(rows))


# ============================================================================================ EAGLE
def eagle_batch(gens: Sequence[Generation], feats: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Right-padded (ids [B, L], prev [B, L, H] = features shifted right by one with f_{-1} = 0, feats [B, L, H],
    labels [B, L] = x_{p+1} or -100, valid [B, L]: a real position)."""
    length, hidden = max(len(p) + len(o) for p, o in gens), feats[0].shape[-1]
    ids = torch.zeros(len(gens), length, dtype=torch.long)
    labels = torch.full((len(gens), length), -100, dtype=torch.long)
    f = torch.zeros(len(gens), length, hidden)
    valid = torch.zeros(len(gens), length, dtype=torch.bool)
    for b, ((p, o), fb) in enumerate(zip(gens, feats)):
        n = len(p) + len(o)
        ids[b, :n] = torch.tensor(p + o)
        labels[b, :n - 1] = ids[b, 1:n]
        f[b, :n] = fb.float()
        valid[b, :n] = True
    prev = torch.cat([torch.zeros(len(gens), 1, hidden), f[:, :-1]], dim=1)
    return ids, prev, f, labels, valid


def eagle_loss(head: EagleHead, ids: Tensor, prev: Tensor, feats: Tensor, labels: Tensor, valid: Tensor,
               ce_weight: float = 0.1) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, smooth L1, CE): SmoothL1(f_hat_p, f_p) over real positions + ce_weight * CE(logits(f_hat_p), x_{p+1}),
    with the teacher's features as inputs (EAGLE's training)."""
    x = head.inputs(ids, prev)
    f_hat = head.model.model(inputs_embeds=x).last_hidden_state
    reg = F.smooth_l1_loss(f_hat[valid].float(), feats[valid].float())
    sel = labels >= 0
    ce = F.cross_entropy(head.model.lm_head(f_hat[sel]).float(), labels[sel])
    return reg + ce_weight * ce, reg, ce


def train_eagle(head: EagleHead, gens: Sequence[Generation], feats: Sequence[Tensor], steps: int, batch_size: int = 8,
                lr: float = 1e-3, ce_weight: float = 0.1, seed: int = 0, bf16: bool = False,
                max_seconds: float | None = None, log_every: int = 0) -> TrainResult:
    """Train `head` (attached to the target: its embedding and LM head frozen) on batches of whole sequences."""
    params = [p for p in head.parameters() if p.requires_grad]
    batch_at = batch_stream([len(p) + len(o) for p, o in gens], batch_size, seed)
    head.train()

    def step_loss(step: int) -> Tensor:
        idx = batch_at(step)
        return eagle_loss(head, *eagle_batch([gens[i] for i in idx], [feats[i] for i in idx]), ce_weight)[0]

    result = train_loop([{"params": params, "lr": lr}], step_loss, steps, max_seconds=max_seconds, bf16=bf16,
                        log_every=log_every, name="eagle")
    head.eval()
    return result


def rollout_mask(length: int, steps: int) -> Tensor:
    """[steps * L, steps * L] bool (True = may attend) for `eagle_rollout`. Row (pass a, position q) is draft
    step a from start s = q - a + 1: it sees pass 1 (inputs with the teacher's features) at positions <= s,
    and pass b (2 <= b <= a, inputs with the head's own features) at position s + b - 1 only: exactly the keys
    the head's KV cache holds when drafting from s."""
    a = torch.arange(steps).repeat_interleave(length)[:, None] + 1       # pass of the query (1-based)
    q = torch.arange(length).repeat(steps)[:, None]
    b = torch.arange(steps).repeat_interleave(length)[None, :] + 1       # pass of the key
    k = torch.arange(length).repeat(steps)[None, :]
    s = q - a + 1
    return ((b == 1) & (k <= s)) | ((b >= 2) & (b <= a) & (k == s + b - 1))


@torch.no_grad()
def eagle_rollout(head: EagleHead, token_ids: Tensor, feats: Tensor, steps: int) -> Tensor:
    """Autoregressive drafting from every start at once: [steps, L, hidden] where out[j-1, q] is the feature the
    head predicts at draft step j from start s = q - j + 1 (its guess for x_{q+1}), the true tokens as inputs
    (the context of a draft whose earlier guesses were right) and, from step 2 on, its own features. Step 1 is
    the teacher-forced prediction. All steps run as one sequence of passes with `rollout_mask`."""
    length = token_ids.shape[0]
    emb = head.model.model.embed_tokens(token_ids)
    zero = torch.zeros(1, feats.shape[-1], dtype=emb.dtype)
    inputs = [head.fc(torch.cat([emb, torch.cat([zero, feats[:-1].to(emb.dtype)])], -1))]
    outs = []
    for j in range(1, steps + 1):
        x = torch.cat(inputs)[None]
        pos = torch.arange(length).repeat(j)[None]
        f = head.model.model(inputs_embeds=x, attention_mask=rollout_mask(length, j)[None, None],
                             position_ids=pos).last_hidden_state[0, (j - 1) * length:]
        outs.append(f)
        inputs.append(head.fc(torch.cat([emb, torch.cat([zero, f[:-1]])], -1)))
    return torch.stack(outs)


@torch.no_grad()
def eval_eagle(head: EagleHead, gens: Sequence[Generation], feats: Sequence[Tensor], k: int = K) -> dict:
    """Teacher-forced accuracy of x_{p+1} from f_hat_p over output tokens, and the drafting metrics of
    `eagle_rollout` (guess j from start s is made at position s + j - 1)."""
    head.eval()
    rows, hits, total = [], 0, 0
    for (p, o), f in zip(gens, feats):
        seq = torch.tensor(p + o)
        guess = head.model.lm_head(eagle_rollout(head, seq, f.float(), k)).argmax(-1)        # [k, L]
        ok = guess[:, :-1] == seq[1:]                                                        # ok[j-1, q]
        hits, total = hits + int(ok[0, len(p) - 1:].sum()), total + len(o)
        rows += [torch.stack([ok[j, s + j] for j in range(k)]) for s in draft_starts(len(p), len(seq), k)]
    return {"teacher_forced_acc": round(hits / max(total, 1), 4), **chain_metrics(torch.stack(rows))}


# ============================================================================================ commands
def load_generations() -> list[Generation]:
    if not GENERATIONS_PATH.exists():
        raise SystemExit(f"{GENERATIONS_PATH} is missing: run `python scripts/train_spec_drafts.py data` first")
    return [(list(p), list(o)) for p, o in torch.load(GENERATIONS_PATH, weights_only=True)]


def update_report(section: str, value: dict) -> None:
    report = json.loads(REPORT_PATH.read_text()) if REPORT_PATH.exists() else {}
    report[section] = value
    REPORT_PATH.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({section: value}, indent=1), flush=True)


def cmd_data(args) -> None:
    from llmso_lab.engine import LLM
    from llmso_lab.quality import load_eval_text
    SPEC_DIR.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(load_eval_text(CALIB_PATH))
    PROMPTS_PATH.write_text(json.dumps(prompts, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(prompts)} prompts to {PROMPTS_PATH}")
    if args.prompts_only:
        return
    llm = LLM(TARGET, max_num_seqs=32)
    ids = [chat_ids(llm.tokenizer, p["messages"]) for p in prompts]
    t0 = time.perf_counter()
    gens = generate(llm, ids)
    seconds = time.perf_counter() - t0
    torch.save(gens, GENERATIONS_PATH)
    n_out = [len(o) for _, o in gens]
    stats = {"prompts": len(gens), "heldout": len(split_heldout(gens)[1]), "prompt_tokens": sum(len(p) for p, _ in gens),
             "output_tokens": sum(n_out), "finished_by_eos": sum(n < MAX_TOKENS for n in n_out),
             "kinds": {k: sum(p["kind"] == k for p in prompts) for k in sorted({p["kind"] for p in prompts})},
             "generate_seconds": round(seconds, 1)}
    update_report("data", stats)


def features_cache() -> Path:
    """Where the target's features for the current generations are cached (not committed: ~140 MB)."""
    from llmso_lab.models import cache_dir
    digest = hashlib.sha256(GENERATIONS_PATH.read_bytes()).hexdigest()[:12]
    return cache_dir() / "spec" / f"features_{digest}.pt"


def load_features(target: nn.Module, gens: list[Generation], bf16: bool) -> list[Tensor]:
    path = features_cache()
    if path.exists():
        return torch.load(path, weights_only=True)
    print(f"computing the target's features for {len(gens)} sequences (once; cached in {path})", flush=True)
    t0 = time.perf_counter()
    feats = target_features(target, gens, bf16=bf16, log_every=50)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(feats, path)
    update_report("features", {"seconds": round(time.perf_counter() - t0, 1), "bf16": bf16,
                               "tokens": sum(f.shape[0] for f in feats)})
    return feats


def weights_path(args, final: Path) -> Path:
    """`final` (data/spec/...), or for a trial (--no-save) a file in the cache: data/spec is left alone."""
    if not args.no_save:
        return final
    from llmso_lab.models import cache_dir
    path = cache_dir() / "spec" / "trials" / f"{final.stem}_{args.tag}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def display_path(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def report_key(args, method: str) -> str:
    return method if not args.no_save else f"{method}_trial_{args.tag}"


def cmd_draft(args, target) -> None:
    train, held = split_heldout(load_generations())
    cfg = draft_config(target.config.vocab_size, args.hidden, args.layers, args.intermediate)
    emb = (None if args.emb_init == "random" else
           draft_embedding(target.get_input_embeddings().weight, args.hidden, args.emb_std, args.emb_init == "whitened"))
    model = make_draft_model(cfg, emb, args.seed)
    print(f"draft model: hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}: "
          f"{num_params(model) / 1e6:.2f}M parameters (SmolLM2: {num_params(target) / 1e6:.1f}M)", flush=True)
    frozen_metrics: dict = {}

    def before_unfreeze() -> None:
        frozen_metrics.update(eval_draft(model, held))
        print(f"  [draft] held-out before unfreezing the embedding: {frozen_metrics}", flush=True)

    result = train_draft(model, train, args.steps or 400, args.batch_size or 8, args.lr or 3e-3,
                         embed_lr=args.embed_lr, unfreeze_at=None if args.frozen_embedding else args.unfreeze_at, seed=args.seed, bf16=not args.fp32,
                         max_seconds=args.max_seconds, log_every=25, on_unfreeze=before_unfreeze)
    metrics = eval_draft(model, held)
    out = {"config": {"hidden_size": args.hidden, "num_layers": args.layers, "intermediate_size": args.intermediate,
                      "emb_init": args.emb_init, "emb_std": args.emb_std, "unfreeze_at": None if args.frozen_embedding else args.unfreeze_at,
                      "embed_lr": args.embed_lr,
                      "lr": args.lr or 3e-3,
                      "batch_size": args.batch_size or 8, "bf16": not args.fp32},
           "params": num_params(model), "target_params": num_params(target), "train": result.summary(),
           "heldout": metrics, "heldout_before_unfreeze": frozen_metrics or None}
    path = weights_path(args, DRAFT_PATH)
    save_draft_model(model, path, target=TARGET)
    out["file_bytes"], out["weights"] = path.stat().st_size, display_path(path)
    assert torch.equal(load_draft_model(path).lm_head.weight, model.lm_head.weight.half().float())
    update_report(report_key(args, "draft"), out)


def cmd_medusa(args, target, feats) -> None:
    gens = load_generations()
    train, held = split_heldout(gens)
    outputs_only = args.medusa_positions == "outputs"
    h, targets = medusa_examples(train, feats[:len(train)], K, outputs_only=outputs_only)
    print(f"medusa: {h.shape[0]} training rows ({args.medusa_positions} positions)", flush=True)
    lm_head = target.get_output_embeddings().weight.detach()
    torch.manual_seed(args.seed)
    heads = MedusaHeads(target.config.hidden_size, K)
    result = train_medusa(heads, lm_head, h, targets, args.steps or 350, args.batch_size or 256, args.lr or 1e-3,
                          seed=args.seed, bf16=not args.fp32, max_seconds=args.max_seconds, log_every=25)
    out = {"config": {"positions": args.medusa_positions, "lr": args.lr or 1e-3, "batch_size": args.batch_size or 256,
                      "bf16": not args.fp32, "rows": int(h.shape[0])},
           "train": result.summary(), "heldout": eval_medusa(heads, lm_head, held, feats[len(train):])}
    path = weights_path(args, MEDUSA_PATH)
    save_head(heads, path, target=TARGET, positions=args.medusa_positions)
    out["file_bytes"], out["weights"] = path.stat().st_size, display_path(path)
    update_report(report_key(args, "medusa"), out)


def cmd_eagle(args, target, feats) -> None:
    gens = load_generations()
    train, held = split_heldout(gens)
    torch.manual_seed(args.seed)
    head = EagleHead(target.config, args.eagle_intermediate).attach(target)
    result = train_eagle(head, train, feats[:len(train)], args.steps or 180, args.batch_size or 8, args.lr or 1e-3,
                         ce_weight=args.ce_weight, seed=args.seed, bf16=not args.fp32, max_seconds=args.max_seconds,
                         log_every=10)
    out = {"config": {"intermediate_size": head.intermediate_size, "ce_weight": args.ce_weight, "lr": args.lr or 1e-3,
                      "batch_size": args.batch_size or 8, "bf16": not args.fp32},
           "train": result.summary(), "heldout": eval_eagle(head, held, feats[len(train):])}
    path = weights_path(args, EAGLE_PATH)
    save_head(head, path, target=TARGET, ce_weight=args.ce_weight)
    out["file_bytes"], out["weights"] = path.stat().st_size, display_path(path)
    update_report(report_key(args, "eagle"), out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=["data", "draft", "medusa", "eagle", "all"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", type=float, default=340.0, help="time budget of each training (s)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default per method)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16 autocast)")
    ap.add_argument("--prompts-only", action="store_true", help="data: write the prompts, generate nothing")
    ap.add_argument("--hidden", type=int, default=128, help="draft: hidden size")
    ap.add_argument("--layers", type=int, default=6, help="draft: decoder layers")
    ap.add_argument("--intermediate", type=int, default=512, help="draft: MLP size")
    ap.add_argument("--emb-std", type=float, default=0.2, help="draft: std of the PCA-initialised embedding")
    ap.add_argument("--emb-init", choices=["whitened", "pca", "random"], default="whitened",
                    help="draft: the embedding's init: whitened PCA of SmolLM2's, plain PCA, or random")
    ap.add_argument("--unfreeze-at", type=float, default=0.0,
                    help="draft: train the embedding from this fraction of the steps on (0: from the start)")
    ap.add_argument("--frozen-embedding", action="store_true", help="draft: never train the embedding")
    ap.add_argument("--embed-lr", type=float, default=3e-3, help="draft: learning rate of the embedding")
    ap.add_argument("--medusa-positions", choices=["all", "outputs"], default="outputs")
    ap.add_argument("--ce-weight", type=float, default=0.1, help="eagle: weight of the token cross-entropy")
    ap.add_argument("--eagle-intermediate", type=int, default=None, help="eagle: MLP size (default: the target's)")
    ap.add_argument("--features-bf16", action="store_true", help="compute the target's features under bf16 autocast")
    ap.add_argument("--no-save", action="store_true",
                    help="a trial: report as <method>_trial_<tag>, weights to the cache instead of data/spec")
    ap.add_argument("--tag", default="0")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (1 when another job shares the 2 cores: "
                    "oversubscribed OpenMP threads make matmuls several times slower)")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.command in ("data", "all"):
        cmd_data(args)
        if args.command == "data":
            return
    from llmso_lab.models import load_model
    target, _ = load_model(TARGET)
    for p in target.parameters():
        p.requires_grad_(False)
    if args.command in ("draft", "all"):
        cmd_draft(args, target)
    if args.command in ("medusa", "eagle", "all"):
        feats = load_features(target, load_generations(), args.features_bf16)
        if args.command in ("medusa", "all"):
            cmd_medusa(args, target, feats)
        if args.command in ("eagle", "all"):
            cmd_eagle(args, target, feats)


if __name__ == "__main__":
    main()
