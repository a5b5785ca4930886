"""Lab 07 (speculative decoding) exercises and their public checks.

References: `llmso_lab.spec.verify:verify_with_randoms` (rejection sampling with its random numbers given),
`llmso_lab.spec.verify:greedy_verify`, `llmso_lab.spec.ngram:ngram_propose`,
`llmso_lab.spec.verify:expected_tokens_per_step`, `llmso_lab.spec.verify:speculative_speedup`,
`llmso_lab.kv.block_manager:rollback_blocks`, and `llmso_lab.spec.drafters:NgramDrafter` (the engine's prompt-lookup
drafter, graded by running the engine with the student's class: `llmso_lab.spec.harness:run_drafter`). Random inputs are small and seeded: the same everywhere.
"""
import torch

from llmso_lab.grading.compare import close, exact
from llmso_lab.grading.registry import Case, Exercise, register

VERIFY_CODE = ("llmso_lab.spec.verify:speculative_verify", "llmso_lab.spec.verify:verify_batch_reference",
               "llmso_lab.spec.verify:verify_batch", "llmso_lab.spec.verify:race_scores")


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def probs(rows: int, vocab: int, seed: int, sharp: float = 2.0, zeros: int = 0) -> torch.Tensor:
    """Random distributions [rows, vocab]; `zeros` tokens per row get no mass (top-k filtered)."""
    p = (torch.randn(rows, vocab, generator=gen(seed)) * sharp).softmax(-1)
    if zeros:
        p[:, torch.randperm(vocab, generator=gen(seed + 1))[:zeros]] = 0.0
        p = p / p.sum(-1, keepdim=True)
    return p


def verify_case(k: int, vocab: int, seed: int, one_hot: bool = False, u_scale: float = 1.0, same: bool = False):
    """(target_probs [k+1, V], draft_probs [k, V], draft_tokens [k], accept_u [k], exp_noise [V]): drafts sampled
    from q (one-hot q: n-gram style)."""
    p = probs(k + 1, vocab, seed, zeros=vocab // 4)
    q = p[:k].clone() if same else 0.5 * p[:k] + 0.5 * probs(k, vocab, seed + 7, sharp=1.0)   # a draft that half agrees
    d = torch.multinomial(p[:k] if u_scale < 1 else q, 1, generator=gen(seed + 2)).reshape(-1) if k else \
        torch.zeros(0, dtype=torch.int64)   # tiny u: tokens the target likes (p(d) > 0), so all are accepted
    if one_hot:
        q = torch.nn.functional.one_hot(d, vocab).float()
    u = torch.rand(k, generator=gen(seed + 3)) * u_scale
    noise = torch.empty(vocab).exponential_(generator=gen(seed + 4))
    return p, q, d, u, noise


register(
    Exercise("speculative_verify", "07", 25, "llmso_lab.spec.verify:verify_with_randoms", [
        Case("k = 3, V = 8, drafts sampled from a random q", verify_case(3, 8, 1)),
        Case("k = 4, V = 6, another seed (rejections happen)", verify_case(4, 6, 2)),
        Case("one-hot q (n-gram drafts): accept iff u < p(d)", verify_case(3, 8, 3, one_hot=True)),
        Case("tiny u: every draft accepted, then the bonus token from p_k", verify_case(3, 8, 4, u_scale=1e-9)),
        Case("q = p: never rejected", verify_case(2, 5, 5, same=True)),
        Case("k = 0: one token from p_0", verify_case(0, 7, 6)),
    ], compare=exact(), tripwires=VERIFY_CODE,
        description="rejection sampling of k drafts with given uniforms and Exp(1) noise: emitted token ids"),
    Exercise("greedy_verify", "07", 10, "llmso_lab.spec.verify:greedy_verify", [
        Case("all accepted: the drafts, then the bonus token", ([5, 9, 2, 7], [5, 9, 2])),
        Case("the first draft is wrong: the target's token only", ([4, 9, 2, 7], [5, 9, 2])),
        Case("a mismatch in the middle", ([5, 9, 3, 7], [5, 9, 2])),
        Case("no drafts (k = 0)", ([11], [])),
        Case("drafts agree again after the mismatch: still only those before it", ([5, 1, 2, 7, 8], [5, 9, 2, 7]),
             hidden=True),
    ], compare=exact(), tripwires=VERIFY_CODE + ("llmso_lab.spec.verify:verify_with_randoms",),
        description="temperature 0: the longest run of drafts equal to the target's argmax, then its own token"),
    Exercise("ngram_propose", "07", 15, "llmso_lab.spec.ngram:ngram_propose", [
        Case("a 3-gram seen before: the tokens that followed it", ([1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3), {"n_min": 2, "n_max": 3}),
        Case("the longest n wins over a shorter, earlier match", ([4, 8, 8, 1, 3, 4, 2, 9, 1, 3, 4], 2), {"n_min": 1, "n_max": 3}),
        Case("two earlier matches: the earliest is used", ([5, 6, 1, 5, 6, 2, 5, 6], 2), {"n_min": 2, "n_max": 2}),
        Case("no match of at least n_min: no draft", ([1, 2, 3, 4, 5, 1], 4), {"n_min": 2, "n_max": 4}),
        Case("fewer than k tokens follow the match", ([4, 5, 6, 4, 5], 5), {"n_min": 2, "n_max": 4}),
    ], compare=exact(),
        description="prompt lookup: up to k tokens that followed the sequence's last n tokens where they occurred before"),
    Exercise("PromptLookupDrafter", "07", 35, "llmso_lab.spec.drafters:NgramDrafter", [
        Case("k = 4, n = 2..4: 4 prompts decoded together", (4, 2, 4)),
        Case("k = 2, n = 1..3, other prompts", (2, 1, 3), {"seed": 1}),
        Case("k = 6 with few KV blocks: sequences are preempted and recomputed", (6, 2, 4), {"seed": 2, "num_kv_blocks": 40}),
        Case("k = 3, 6 prompts, 64 tokens each", (3, 2, 4), {"seed": 3, "num_prompts": 6, "max_tokens": 64}),
    ], compare=exact(), harness="llmso_lab.spec.harness:run_drafter", timeout_s=90,
        tripwires=("llmso_lab.spec.ngram:ngram_propose",),
        description="the engine's prompt-lookup drafter (a Drafter subclass), run in the engine: greedy tokens equal "
                    "plain decoding, blocks freed, drafts and acceptances equal the reference's"),
    Exercise("expected_tokens_per_step", "07", 5, "llmso_lab.spec.verify:expected_tokens_per_step", [
        Case("alpha 0.8, k 4", (0.8, 4)), Case("alpha 0.5, k 1", (0.5, 1)), Case("alpha 0: one token", (0.0, 5)),
        Case("alpha 1: every draft and the bonus", (1.0, 3)), Case("k 0: plain decoding", (0.7, 0)),
    ], compare=close(atol=1e-9, rtol=1e-9), tripwires=("llmso_lab.spec.verify:speculative_speedup",),
        description="(1 - alpha^(k+1)) / (1 - alpha): expected tokens emitted by one verification step"),
    Exercise("speculative_speedup", "07", 5, "llmso_lab.spec.verify:speculative_speedup", [
        Case("alpha 0.8, k 4, a draft costing 5% of the target", (0.8, 4, 0.05)),
        Case("alpha 0.6, k 8, c 0.2: too many drafts", (0.6, 8, 0.2)),
        Case("a free draft (c = 0)", (0.9, 3, 0.0)), Case("alpha 1, c 0.5", (1.0, 2, 0.5)),
    ], compare=close(atol=1e-9, rtol=1e-9), tripwires=("llmso_lab.spec.verify:expected_tokens_per_step",),
        description="expected speed-up over plain decoding: E[tokens per step] / (k c + 1)"),
    Exercise("rollback_blocks", "07", 5, "llmso_lab.kv.block_manager:rollback_blocks", [
        Case("a rejected tail in a fresh block is freed", ([3, 8, 5], 4, 8)),
        Case("a partly filled last block is kept", ([3, 8, 5], 4, 9)),
        Case("nothing to free", ([1, 2], 16, 20)),
        Case("two blocks only rejected drafts used", ([4, 6, 1, 9], 2, 3)),
    ], compare=exact(), tripwires=("llmso_lab.kv.block_manager:BlockManager.trim",),
        description="after verification: the blocks holding the first num_tokens tokens, and those to free"),
)
