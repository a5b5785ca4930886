"""Attacks on the grader found by grading Labs 04-10 as an attacker would (issue 34), each of which must fail.

Each test grades a solution notebook with the attacked exercise's cell replaced by the attack: that exercise earns
only what its honest parts earn, the others keep their points. `check()` (the notebook's own feedback) must not be
fooled either, where the attack can run in the student's kernel.
"""
import re
import textwrap

import pytest
import torch

from llmso_lab.grading import check, get_exercise, sandbox
from llmso_lab.grading.tripwire import DispatcherTripwire
from test_grading_attacks import graded, isolated, level  # noqa: F401 - `level` is a fixture

pytestmark = pytest.mark.timeout(600)


def run_cell(source: str, name: str):
    """Define the cell's function here (for check() in this process)."""
    ns: dict = {}
    exec(compile(textwrap.dedent(source), f"<{name}>", "exec"), ns)
    return ns[name]


# ---- 1. another job's library copy (uid level) --------------------------------------------------------
NEIGHBOUR_THIEF = """\
import os, sys, time, importlib
def kv_waste(lengths, scheme, **kw):
    own = os.environ.get("PYTHONPATH", "")
    seen, errors, end = [], [], time.time() + 20
    while time.time() < end:
        seen = [d for d in os.listdir("/tmp") if d.startswith("llmso-grade-") and "-lib-" not in d
                and not own.startswith(os.path.join("/tmp", d))]
        for d in seen:
            lib = os.path.join("/tmp", d, "lib")
            try:
                os.listdir(os.path.join(lib, "llmso_lab"))
                for m in [m for m in sys.modules if m.startswith("llmso_lab")]:
                    del sys.modules[m]
                sys.path.insert(0, lib)
                return importlib.import_module("llmso_lab.kv.fragmentation").waste(lengths, scheme, **kw)
            except Exception as exc:
                errors.append(f"{d}: {type(exc).__name__}")
        if any(e.startswith("llmso-grade-BlockAllocator-") for e in errors):
            break   # the job graded beside this one was tried (others may be another pytest worker's)
        time.sleep(0.05)
    raise RuntimeError(f"neighbours seen: {len(seen)}; errors: {sorted(set(errors))[:3]}")
"""
SLOW_NEIGHBOUR = """\
import time
time.sleep(8)   # keeps this job (and its library copy) alive while the other exercise looks for it
class BlockAllocator:
    pass
"""


def test_a_job_cannot_read_the_library_copy_of_the_job_beside_it(tmp_path, level):
    tests, res = graded(tmp_path, "04", {"lab04/kv_waste": NEIGHBOUR_THIEF, "lab04/BlockAllocator": SLOW_NEIGHBOUR},
                        only=["kv_waste", "BlockAllocator"], workers=2)
    out = tests["kv_waste"]["output"]
    assert tests["kv_waste"]["score"] == 0, out
    if level == "uid":   # the neighbour's folder is there to be seen (so the test can fail), but not to be read
        # Under pytest-xdist another worker's jobs may sit in /tmp too: each must be unreadable, and the neighbour
        # graded beside this exercise must be among them.
        seen = int(re.search(r"neighbours seen: (\d+)", out).group(1))
        errors = re.findall(r"'(llmso-grade-[^:']+): (\w+)'", out)
        assert seen >= 1 and any(d.startswith("llmso-grade-BlockAllocator-") for d, _ in errors), out
        assert {e for _, e in errors} == {"PermissionError"}, out
    else:                # isolated: its own /tmp, nothing of another job in it
        assert "neighbours seen: 0" in out, out


@isolated
def test_the_jobs_init_does_not_show_the_job_description(tmp_path):
    tests, _ = graded(tmp_path, "00", {"lab00/roofline_time": """\
        def roofline_time(flops, bytes_moved, peak_flops, bandwidth):
            raise ValueError("CMDLINE " + open("/proc/1/cmdline", "rb").read().replace(b"\\0", b" ").decode())
        """}, only=["roofline_time"])
    line = next(ln for ln in tests["roofline_time"]["output"].splitlines() if "CMDLINE" in ln)
    assert "sandbox.py" in line, line   # it did read the init's command line
    for secret in ("binds", "uid", "/job", "rlimits", "llmso_lab.grading.child"):
        assert secret not in line, line


# ---- 2. spec helpers that compute answers -------------------------------------------------------------
KIVI_FROM_ORACLE = """\
from llmso_lab.grading.specs.lab10 import kivi_oracle
def kivi_fake_quantize(k, v, bits, group_size, residual_length):
    return kivi_oracle(k, v, bits, group_size, residual_length)
"""
SNAPKV_FROM_VOTES = """\
import torch
from llmso_lab.grading.specs.lab10 import _pooled_votes
def snapkv_keep(q_obs, k, budget, window, kernel_size=7):
    T = k.shape[1]
    if budget >= T:
        return torch.arange(T).expand(k.shape[0], T).clone()
    top = _pooled_votes(q_obs, k, kernel_size)[:, : T - window].topk(budget - window, dim=-1).indices
    tail = torch.arange(T - window, T).expand(k.shape[0], window)
    return torch.cat([top, tail], dim=-1).sort(dim=-1).values
"""
RING_FROM_ATTEND = """\
import torch
from llmso_lab.grading.specs.lab08 import _attend
def ring_attention_step(o, lse, q, k_blk, v_blk, q_pos, k_pos, scale):
    blk_o, blk_lse = _attend(q.float(), k_blk.float(), v_blk.float(), q_pos, k_pos, scale)
    new = torch.logaddexp(lse, blk_lse)
    safe = new.nan_to_num(neginf=0.0)
    return torch.exp(lse - safe)[..., None] * o + torch.exp(blk_lse - safe)[..., None] * blk_o, new
"""


def test_spec_oracles_and_helpers_are_not_in_the_graders_sandbox(tmp_path):
    tests, _ = graded(tmp_path, "10", {"lab10/kivi_fake_quantize": KIVI_FROM_ORACLE,
                                       "lab10/snapkv_keep": SNAPKV_FROM_VOTES},
                      only=["kivi_fake_quantize", "snapkv_keep", "streaming_keep"])
    assert tests["kivi_fake_quantize"]["score"] == 0, tests["kivi_fake_quantize"]["output"]
    assert tests["snapkv_keep"]["score"] == 0, tests["snapkv_keep"]["output"]
    assert "No module named" in tests["snapkv_keep"]["output"]
    assert tests["streaming_keep"]["score"] == get_exercise("streaming_keep").points
    tests, _ = graded(tmp_path, "08", {"lab08/ring_attention_step": RING_FROM_ATTEND}, only=["ring_attention_step"])
    assert tests["ring_attention_step"]["score"] == 0, tests["ring_attention_step"]["output"]


@pytest.mark.parametrize("name,source", [("kivi_fake_quantize", KIVI_FROM_ORACLE), ("snapkv_keep", SNAPKV_FROM_VOTES),
                                         ("ring_attention_step", RING_FROM_ATTEND)])
def test_check_disables_the_spec_helpers_too(name, source):
    res = check(name, fn=run_cell(source, name))
    # every case that reaches the helper trips (snapkv's budget >= T case returns before it, and passes)
    assert res.passed < res.total and "TRIPWIRE" in repr(res), res


def test_an_exercises_oracle_is_always_disabled():
    for name in ("kivi_fake_quantize", "prefix_cache_hits", "flash_attention"):
        ex = get_exercise(name)
        assert ex.oracle and ex.oracle in ex.disabled, name


# ---- 3. tripwires at the operator, not the name ---------------------------------------------------------
GQA_BY_C_NN = """\
import torch
def gqa_attention(q, k, v, causal=False):
    Nq, Nk = q.shape[2], k.shape[2]
    mask = torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq) if causal else None   # bottom-right
    return torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
"""
GQA_BY_ATEN = """\
import torch
def gqa_attention(q, k, v, causal=False):
    Nq, Nk = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    mask = torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq) if causal else None
    return torch.ops.aten._scaled_dot_product_attention_math(q, k.repeat_interleave(rep, 1),
                                                            v.repeat_interleave(rep, 1), attn_mask=mask)[0]
"""
GQA_UNPLUGGING_THE_WATCH = """\
import gc, torch
def gqa_attention(q, k, v, causal=False):
    for obj in gc.get_objects():
        if isinstance(obj, torch.library.Library):
            obj._destroy()
    rep = q.shape[1] // k.shape[1]
    Nq, Nk = q.shape[2], k.shape[2]
    mask = torch.ones(Nq, Nk, dtype=torch.bool).tril(Nk - Nq) if causal else None
    return torch._C._nn.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                     attn_mask=mask)
"""
MLA_BY_C_NN = """\
import torch
def mla_decode_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
    q = torch.cat([q_lat, q_pe], -1).transpose(0, 1)                   # [H, 1, r + dr]
    k = torch.cat([c_kv, k_pe], -1)[None].expand(q.shape[0], -1, -1)   # [H, S, r + dr]
    v = c_kv[None].expand(q.shape[0], -1, -1)
    o_lat = torch._C._nn.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1)
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)
"""
RING_BY_FLASH_CPU = """\
import torch
def ring_attention_step(o, lse, q, k_blk, v_blk, q_pos, k_pos, scale):
    mask = k_pos[None, :] <= q_pos[:, None]
    blk_o, blk_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.float()[None], k_blk.float()[None], v_blk.float()[None], attn_mask=torch.where(mask, 0.0, float("-inf")),
        scale=scale)
    blk_o, blk_lse = blk_o[0].nan_to_num(0.0), blk_lse[0]
    new = torch.logaddexp(lse, blk_lse)
    safe = new.nan_to_num(neginf=0.0)
    return torch.exp(lse - safe)[..., None] * o + torch.exp(blk_lse - safe)[..., None] * blk_o, new
"""


def test_attention_by_another_name_trips_the_dispatcher(tmp_path):
    tests, _ = graded(tmp_path, "05", {"lab05/gqa_attention": GQA_BY_C_NN, "lab05/mla_decode_absorbed": MLA_BY_C_NN},
                      only=["gqa_attention", "mla_decode_absorbed", "mean_pool_kv_heads"])
    assert tests["gqa_attention"]["score"] == 0 and "TRIPWIRE" in tests["gqa_attention"]["output"], tests["gqa_attention"]
    # MLA leaves torch's SDPA on (the engine its harness runs uses it): SDPA over the latent cache as ONE shared KV head,
    # after folding W_UK into the query, is the absorbed mechanism itself, so it keeps its points
    assert tests["mla_decode_absorbed"]["score"] == get_exercise("mla_decode_absorbed").points, tests["mla_decode_absorbed"]
    assert tests["mean_pool_kv_heads"]["score"] == get_exercise("mean_pool_kv_heads").points
    tests, _ = graded(tmp_path, "05", {"lab05/gqa_attention": GQA_BY_ATEN}, only=["gqa_attention"])
    assert tests["gqa_attention"]["score"] == 0 and "TRIPWIRE" in tests["gqa_attention"]["output"]
    tests, _ = graded(tmp_path, "08", {"lab08/ring_attention_step": RING_BY_FLASH_CPU}, only=["ring_attention_step"])
    assert tests["ring_attention_step"]["score"] == 0 and "TRIPWIRE" in tests["ring_attention_step"]["output"]


def test_removing_the_dispatcher_tripwire_costs_the_exercise(tmp_path):
    tests, _ = graded(tmp_path, "05", {"lab05/gqa_attention": GQA_UNPLUGGING_THE_WATCH}, only=["gqa_attention"])
    out = tests["gqa_attention"]["output"]
    assert tests["gqa_attention"]["score"] == 0 and "was removed or replaced" in out, out
    res = check("gqa_attention", fn=run_cell(GQA_UNPLUGGING_THE_WATCH, "gqa_attention"))
    assert res.passed == 0 and "was removed or replaced" in repr(res), res
    q = torch.randn(1, 2, 3, 4)
    torch.nn.functional.scaled_dot_product_attention(q, q, q)   # and check() left torch as it found it


@pytest.mark.parametrize("name,source", [("gqa_attention", GQA_BY_C_NN), ("gqa_attention", GQA_BY_ATEN),
                                         ("ring_attention_step", RING_BY_FLASH_CPU)])
def test_check_trips_on_the_operator_too(name, source):
    res = check(name, fn=run_cell(source, name))
    # every case that reaches the helper trips (snapkv's budget >= T case returns before it, and passes)
    assert res.passed < res.total and "TRIPWIRE" in repr(res), res


def test_the_dispatcher_tripwire_covers_every_route_and_leaves_other_ops_alone():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    kk = k.repeat_interleave(2, 1)
    routes = {
        "F": lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, kk),
        "torch._C._nn": lambda: torch._C._nn.scaled_dot_product_attention(q, k, k, enable_gqa=True),
        "aten": lambda: torch.ops.aten.scaled_dot_product_attention(q, kk, kk),
        "aten math": lambda: torch.ops.aten._scaled_dot_product_attention_math(q, kk, kk),
        "aten flash cpu": lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kk, kk),
        "with autograd": lambda: torch.nn.functional.scaled_dot_product_attention(q.clone().requires_grad_(), kk, kk),
    }
    with DispatcherTripwire(("torch.nn.functional:scaled_dot_product_attention",), "demo") as watch:
        for name, route in routes.items():
            with pytest.raises(RuntimeError, match="TRIPWIRE"):
                route()
        assert torch.softmax(q @ kk.transpose(-1, -2), -1).shape == (1, 4, 3, 3)   # plain ops still run
        assert watch.intact()
    assert not watch.intact() or not watch._dumps   # removed: the dispatcher is back to torch's own kernels
    for route in routes.values():
        route()


# ---- 4. a library equivalent ---------------------------------------------------------------------------
STREAMING_BY_BLOCKS = """\
import torch
from llmso_lab.kv.streaming import streaming_block_keep
def streaming_keep(seq_len, budget, num_sink=4):
    return torch.tensor(streaming_block_keep(seq_len, num_sink, budget - num_sink - 1), dtype=torch.long)
"""


def test_the_block_keep_set_of_the_engine_is_disabled_for_streaming_keep(tmp_path):
    tests, _ = graded(tmp_path, "10", {"lab10/streaming_keep": STREAMING_BY_BLOCKS}, only=["streaming_keep"])
    assert tests["streaming_keep"]["score"] == 0 and "TRIPWIRE" in tests["streaming_keep"]["output"]


TP_MLP_BY_LIBRARY_LINEARS = """\
from llmso_lab.parallel.tensor import column_parallel_linear, row_parallel_linear
import torch
def tp_mlp_forward(x, gate, up, down, group):
    r, tp = group.rank, group.size
    h = torch.nn.functional.silu(column_parallel_linear(x, gate, r, tp)) * column_parallel_linear(x, up, r, tp)
    return group.all_reduce(row_parallel_linear(h, down, r, tp))
"""
PIPELINE_BY_LIBRARY = """\
from llmso_lab.parallel.pipeline import gpipe_stage as pipeline_stage
"""


def test_lab08_mechanisms_run_in_ranks_cannot_borrow_the_library(tmp_path):
    """The harness runs the student's function inside forked ranks: the stubs and tripwires are there too."""
    tests, _ = graded(tmp_path, "08", {"lab08/tp_mlp_forward": TP_MLP_BY_LIBRARY_LINEARS,
                                       "lab08/pipeline_stage": PIPELINE_BY_LIBRARY},
                      only=["tp_mlp_forward", "pipeline_stage"])
    for name in ("tp_mlp_forward", "pipeline_stage"):
        assert tests[name]["score"] == 0, tests[name]["output"]
    assert "TRIPWIRE" in tests["tp_mlp_forward"]["output"], tests["tp_mlp_forward"]["output"]


# ---- 5. documented errors are graded -------------------------------------------------------------------
SHARD_BY_CHUNK = """\
import torch
def shard_linear(weight, rank, tp, style):
    return torch.chunk(weight, tp, dim=0 if style == "column" else 1)[rank]
"""
STREAMING_WITHOUT_ERROR = """\
import torch
def streaming_keep(seq_len, budget, num_sink=4):
    if budget >= seq_len:
        return torch.arange(seq_len)
    return torch.cat([torch.arange(num_sink), torch.arange(seq_len - (budget - num_sink), seq_len)])
"""


def test_leaving_out_the_documented_valueerror_loses_points(tmp_path):
    tests, _ = graded(tmp_path, "08", {"lab08/shard_linear": SHARD_BY_CHUNK}, only=["shard_linear"])
    out = tests["shard_linear"]["output"]
    assert 0 < tests["shard_linear"]["score"] < get_exercise("shard_linear").points, out
    assert "expected ValueError" in out, out
    tests, _ = graded(tmp_path, "10", {"lab10/streaming_keep": STREAMING_WITHOUT_ERROR}, only=["streaming_keep"])
    assert 0 < tests["streaming_keep"]["score"] < get_exercise("streaming_keep").points
    assert "expected ValueError" in tests["streaming_keep"]["output"]


def test_an_error_case_needs_that_error_not_any_error():
    """Raising the wrong exception, or a cell's own class named ValueError, does not pass an error case."""
    def keep(prelude: str, error: str):
        return run_cell(prelude + textwrap.dedent(f"""\
        def streaming_keep(seq_len, budget, num_sink=4):
            if budget < num_sink + 1:
                raise {error}("budget too small")
            import torch
            return torch.cat([torch.arange(num_sink), torch.arange(seq_len - (budget - num_sink), seq_len)]) \\
                if budget < seq_len else torch.arange(seq_len)
        """), "streaming_keep")

    wrong_type = keep("", "TypeError")
    own_class = keep("class ValueError(Exception):\n    pass\n", "ValueError")
    subclass = keep("class BudgetError(ValueError):\n    pass\n", "BudgetError")
    total = check("streaming_keep", fn=subclass).total
    assert check("streaming_keep", fn=subclass).passed == total
    for fn in (wrong_type, own_class):
        res = check("streaming_keep", fn=fn)
        assert res.passed == total - 2 and "expected ValueError" in repr(res), res


def test_a_killed_graders_folders_are_removed_before_its_slot_is_reused(tmp_path, monkeypatch):
    """A grader killed mid-job leaves its job folder (a library copy, answers) readable by that slot's group; the
    next job given the same slot (and so the same group) must not find it: taking a slot removes them first.
    The sweep runs in a temp dir of this test's own: in the shared one, sweeping our own group (root's, 0) would
    delete the live library copy of a grading run in the other pytest worker."""
    import os
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))       # mkdtemp and the sweep both use it
    mine = tempfile.mkdtemp(prefix="llmso-grade-stale-")          # a stale job folder of our own group
    other = tempfile.mkdtemp(prefix="llmso-grade-other-")
    gid = os.getegid()
    try:
        if os.geteuid() == 0:
            os.chown(other, 0, gid + 1)                           # another group's folder stays
        removed = sandbox.remove_stale_job_dirs(gid)
        assert mine in removed and not os.path.exists(mine)
        assert os.path.exists(other) == (os.geteuid() == 0)
        if os.geteuid() == 0:   # the sandbox's own path: a folder of a slot's group is gone once the slot is taken
            with sandbox.Slot() as slot:
                stale = tempfile.mkdtemp(prefix="llmso-grade-stale-")
                os.chown(stale, 0, slot.uid)
            with sandbox.Slot() as again:
                assert again.uid != slot.uid or not os.path.exists(stale)
            if os.path.exists(stale):   # (another slot was free first: clean up ourselves)
                sandbox.remove_stale_job_dirs(slot.uid)
    finally:
        for path in (mine, other):
            if os.path.exists(path):
                os.rmdir(path)


# ---- Lab 09 / Lab 10 mechanism exercises: the library's own mechanism is disabled inside the harness --------------
POLICY_FROM_LIBRARY = """\
from llmso_lab.kv.streaming import StreamingEvictionPolicy as _Lib
class StreamingEvictionPolicy(_Lib):
    pass
"""
POLICY_FROM_RULE = """\
from llmso_lab.kv.streaming import StreamingEviction, max_chunk_tokens, num_blocks_to_evict
class StreamingEvictionPolicy:
    def __init__(self, num_sink_blocks, window_blocks, block_size, release):
        self.ev, self.bs, self.release = StreamingEviction(num_sink_blocks, window_blocks), block_size, release
    def cap(self, seq, n):
        n = min(n, max_chunk_tokens(seq.num_computed_tokens, self.bs, self.ev))
        k = num_blocks_to_evict(seq.num_computed_tokens, n, seq.num_dropped_blocks, self.bs, self.ev)
        s = self.ev.num_sink_blocks
        for b in seq.block_table[s:s + k]:
            self.release(b)
        del seq.block_table[s:s + k]
        seq.num_dropped_blocks += k
        return n
"""
SELECT_FROM_LIBRARY = """\
from llmso_lab.kv.blend import kv_deviation, select_tokens
def cacheblend_select(new, old, ratio):
    return select_tokens(kv_deviation(new, old), ratio)
"""
RECEIVE_FROM_SLOTS = """\
from llmso_lab.disagg.worker import slots_of
def write_received_kv(caches, layer, payload, block_table, block_size, start):
    slots = slots_of(block_table, block_size, start, start + payload.shape[1])
    for c, rows in zip(caches, payload):
        c[layer].view(-1, *c.shape[-2:]).index_copy_(0, slots, rows)
"""

MLA_FROM_LIBRARY = """\
from llmso_lab.attention.mla import mla_attention
def mla_decode_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):
    return mla_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale)
"""
BOUNDED_FROM_LIBRARY = """\
import bisect
from llmso_lab.routing import bounded_load_pick as library_pick
def bounded_load_pick(ring, key, loads, c):
    i, order = bisect.bisect_left([p for p, _ in ring], key), []
    for j in range(len(ring)):
        r = ring[(i + j) % len(ring)][1]
        if r not in order:
            order.append(r)
    return library_pick(order, loads, c)
"""


@pytest.mark.parametrize("lab,name,source", [
    ("05", "mla_decode_absorbed", MLA_FROM_LIBRARY), ("04", "bounded_load_pick", BOUNDED_FROM_LIBRARY),
    ("10", "StreamingEvictionPolicy", POLICY_FROM_LIBRARY), ("10", "StreamingEvictionPolicy", POLICY_FROM_RULE),
    ("10", "cacheblend_select", SELECT_FROM_LIBRARY), ("09", "write_received_kv", RECEIVE_FROM_SLOTS)])
def test_a_mechanism_exercise_cannot_hand_the_harness_the_librarys_mechanism(tmp_path, lab, name, source):
    """The harness runs the engine / blend / handoff for real, but with the library's own policy, selection and slot
    arithmetic disabled: a submission that delegates to them earns nothing (only a case that never reaches them,
    e.g. ratio 0, could pass)."""
    tests, _ = graded(tmp_path, lab, {f"lab{lab}/{name}": source}, only=[name])
    assert tests[name]["score"] < get_exercise(name).points / 2, tests[name]["output"]
    assert "TRIPWIRE" in tests[name]["output"]


# ---- Lab 07: the drafter exercise runs the engine, with the library's drafter and prompt lookup disabled --------
DRAFTER_FROM_LIBRARY = """\
from llmso_lab.spec.drafters import NgramDrafter
class PromptLookupDrafter(NgramDrafter):
    pass
"""
DRAFTER_FROM_LOOKUP = """\
from llmso_lab.spec.drafters import Drafter
from llmso_lab.spec.ngram import ngram_propose
class PromptLookupDrafter(Drafter):
    def __init__(self, n_min=2, n_max=4):
        self.n_min, self.n_max = n_min, n_max
    def propose(self, items):
        return [(ngram_propose(i.seq.token_ids, i.num_lookahead, self.n_min, self.n_max), None) for i in items]
"""


@pytest.mark.parametrize("source", [DRAFTER_FROM_LIBRARY, DRAFTER_FROM_LOOKUP], ids=["subclass", "lookup"])
def test_lab07_drafter_cannot_hand_the_engine_the_librarys_prompt_lookup(tmp_path, source):
    tests, _ = graded(tmp_path, "07", {"lab07/PromptLookupDrafter": source}, only=["PromptLookupDrafter"])
    assert tests["PromptLookupDrafter"]["score"] == 0, tests["PromptLookupDrafter"]["output"]
    assert "TRIPWIRE" in tests["PromptLookupDrafter"]["output"]


# ---- patching the library in the student's process changes nothing the grader measures --------------------------
FORGE_HARNESS = """\
import llmso_lab.parallel.tensor as tensor
def tp_mlp_forward(x, gate, up, down, group):
    return x   # wrong: no MLP at all
def _perfect(fn, tp, **kw):
    return {"output_equals_tp1": True, "ranks_agree": True, "all_reduces_per_rank": [1] * tp,
            "partial_is_rank_share": True, "max_abs_diff": 0.0}
tensor.run_tp_mlp = _perfect   # the harness itself, replaced by a report that says 'perfect'
"""
FORGE_TORCH = """\
import torch
def tp_mlp_forward(x, gate, up, down, group):
    y = x @ gate.t()   # wrong shape and values
    group.all_reduce(y)
    return y
torch.equal = lambda *a, **k: True   # a comparison the harness may make, made to always agree
"""
FORGE_CLASS = """\
import llmso_lab.parallel.launcher as launcher
def tp_mlp_forward(x, gate, up, down, group):
    return x
launcher.RankError.brief = lambda self: None   # a library class's method
"""


@pytest.mark.parametrize("source", [FORGE_HARNESS, FORGE_TORCH, FORGE_CLASS], ids=["harness", "torch", "class"])
def test_patching_what_a_harness_measures_with_earns_nothing(tmp_path, source):
    """The harness runs in the grader (issue 49): what the submission replaces in its own process is not what
    measures it, so the wrong MLP behind the patch is graded as the wrong MLP it is."""
    tests, _ = graded(tmp_path, "08", {"lab08/tp_mlp_forward": source}, only=["tp_mlp_forward"])
    t = tests["tp_mlp_forward"]
    assert t["score"] == 0, t["output"]
