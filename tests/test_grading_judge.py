"""The mechanism exercises are judged outside the student's process (issue 49): each class of forgery that worked
when the harness ran in the student's process now earns only what its honest part earns.

Each test grades a solution notebook with one exercise cell replaced by the attack (only that exercise). The score
each attack got before the harness moved to the grader (the same attack graded by the code of 9634bfe) is in its
docstring; after, it must lose the points the forgery was meant to win.
"""
import pytest
import torch

from llmso_lab.grading import check, get_exercise
from llmso_lab.grading.judge import LogicalPipeline, StarAllReduce
from llmso_lab.parallel.tensor import mlp_weights, share_features, tp_mlp_case, tp_mlp_report
from test_grading_attacks import graded
from test_grading_attacks_labs04_10 import run_cell

pytestmark = pytest.mark.timeout(600)

PERFECT_TP = ('{"output_equals_tp1": True, "ranks_agree": True, "all_reduces_per_rank": [1] * 4, '
              '"partial_is_rank_share": True, "max_abs_diff": 0.0}')

# ---- class 1: rewriting a harness function (or the child's own `attempt`) in place -----------------------------
REWRITE_HARNESS = f"""\
import llmso_lab.parallel.tensor as tensor
def tp_mlp_forward(x, gate, up, down, group):
    return x   # wrong: no MLP at all
def _perfect(*args, **kwargs):
    tp = args[1] if len(args) > 1 else 4
    report = {PERFECT_TP}
    report["all_reduces_per_rank"] = [1] * tp
    return report
tensor.run_tp_mlp.__code__ = _perfect.__code__   # same identity, so an id()-based guard sees nothing
"""
REWRITE_ATTEMPT = f"""\
import llmso_lab.grading.protocol as protocol
def tp_mlp_forward(x, gate, up, down, group):
    return x
def _forged(*args, **kwargs):
    case = args[1] if len(args) > 1 and hasattr(args[1], "args") else None   # attempt(target, case, kind, file)
    report = {PERFECT_TP}
    report["all_reduces_per_rank"] = [1] * (case.args[0] if case is not None else 2)
    return {{"ok": True, "value": report}}
for name in ("attempt", "attempt_call"):   # whatever the child runs each case (or call) with
    if hasattr(protocol, name):
        getattr(protocol, name).__code__ = _forged.__code__
"""


@pytest.mark.parametrize("source", [REWRITE_HARNESS, REWRITE_ATTEMPT], ids=["harness", "attempt"])
def test_class1_rewriting_the_harness_in_place_earns_nothing(tmp_path, source):
    """Before: 30 / 30 (the forged report came back from the student's process). After: 0."""
    tests, _ = graded(tmp_path, "08", {"lab08/tp_mlp_forward": source}, only=["tp_mlp_forward"])
    assert tests["tp_mlp_forward"]["score"] == 0, tests["tp_mlp_forward"]["output"]


# ---- class 2: reading the expected answer from the frames of the process that computed it -----------------------
READ_PARENT_FRAMES = """\
import sys
def tp_mlp_forward(x, gate, up, down, group):
    f = sys._getframe(1)
    while f is not None:
        loc = f.f_locals
        if "full" in loc and "shares" in loc:   # the harness's expected output and each rank's share
            group.all_reduce(loc["shares"][group.rank].clone())
            return loc["full"].clone()
        f = f.f_back
    raise RuntimeError("no answer in any frame")
"""


def test_class2_no_answer_lives_in_the_students_process(tmp_path):
    """Before: 30 / 30 (ranks were forked from the harness frame holding `full` and `shares`). After: 0."""
    tests, _ = graded(tmp_path, "08", {"lab08/tp_mlp_forward": READ_PARENT_FRAMES}, only=["tp_mlp_forward"])
    t = tests["tp_mlp_forward"]
    assert t["score"] == 0 and "no answer in any frame" in t["output"], t["output"]


# ---- class 3: an object that lies to the comparison ---------------------------------------------------------
LYING_TENSOR = """\
import os, sys, torch
# the subclass lives in a module, so that it survives being pickled back from a rank
with open("liar.py", "w") as f:
    f.write(
        "import torch\\n"
        "class Liar(torch.Tensor):\\n"
        "    @classmethod\\n"
        "    def __torch_function__(cls, func, types, args=(), kwargs=None):\\n"
        "        if getattr(func, '__name__', '') in ('equal', 'allclose', 'all', '__bool__', '__eq__'):\\n"
        "            return True\\n"
        "        return super().__torch_function__(func, types, args, kwargs or {})\\n")
sys.path.insert(0, os.getcwd())
from liar import Liar
def tp_mlp_forward(x, gate, up, down, group):
    y = torch.zeros(x.shape[0], gate.shape[1]).as_subclass(Liar)
    group.all_reduce(y)
    return y
"""


def test_class3_a_tensor_subclass_cannot_answer_the_comparison(tmp_path):
    """Before: 30 / 30 (compared in the student's process, equal/allclose/all said True). After: 0 (the child sends
    plain tensors; the grader compares)."""
    tests, _ = graded(tmp_path, "08", {"lab08/tp_mlp_forward": LYING_TENSOR}, only=["tp_mlp_forward"])
    assert tests["tp_mlp_forward"]["score"] == 0, tests["tp_mlp_forward"]["output"]


# ---- class 4: a measurement the student's code can write ----------------------------------------------------------
REWRITE_CLOCK = """\
def pipeline_stage(stage, num_stages, num_microbatches, inputs, compute, send, recv):
    # a wrong schedule: collect every micro-batch first (bubble (p - 1) / p), ...
    xs = [inputs[j] if stage == 0 else recv(stage - 1) for j in range(num_microbatches)]
    ys = [compute(x) for x in xs]
    # ... then rewrite what the clock recorded as GPipe's ideal slots
    for cell in compute.__closure__ or ():
        v = cell.cell_contents
        if isinstance(v, list) and len(v) == num_microbatches and all(isinstance(t, tuple) for t in v):
            v[:] = [(float(stage + j), float(stage + j + 1)) for j in range(num_microbatches)]
    for y in ys:
        if stage + 1 < num_stages:
            send(y, stage + 1)
    return ys if stage + 1 == num_stages else None
"""


def test_class4_the_logical_clock_is_out_of_reach(tmp_path):
    """Before: 20 / 20 (the clock's lists sat in compute's closure, in the stage's process). After: 0, what the
    collect-first schedule earns."""
    tests, _ = graded(tmp_path, "08", {"lab08/pipeline_stage": REWRITE_CLOCK}, only=["pipeline_stage"])
    t = tests["pipeline_stage"]
    assert t["score"] == 0 and "bubble" in t["output"], t["output"]


# ---- class 5: delegation the name-based scan did not see -------------------------------------------------------
TP_FROM_ENGINE = """\
import types
from llmso_lab.parallel.tensor import shard_llama_layer
from llmso_lab.engine.ops import swiglu_mlp
def tp_mlp_forward(x, gate, up, down, group):
    lin = lambda w: types.SimpleNamespace(weight=w, bias=None)
    heads = torch.zeros(group.size, 1)   # one 1-wide head per rank: the attention half is not used
    attn = types.SimpleNamespace(q_proj=lin(heads), k_proj=lin(heads), v_proj=lin(heads), o_proj=lin(heads.t()))
    layer = types.SimpleNamespace(self_attn=attn, mlp=types.SimpleNamespace(gate_proj=lin(gate), up_proj=lin(up),
                                                                             down_proj=lin(down)))
    w = shard_llama_layer(layer, group.rank, group.size, head_dim=1)   # the engine's own TP shard
    return group.all_reduce(swiglu_mlp(x, torch.cat([w["gate"], w["up"]]).t(), None, w["down"].t(), None))
"""
BUBBLE_FROM_MEASURE = """\
from llmso_lab.parallel.pipeline import Interval, measured_bubble
def bubble_fraction(num_stages, num_microbatches):
    timeline = [Interval(s, j, "prefill", s + j, s + j + 1) for s in range(num_stages) for j in range(num_microbatches)]
    return measured_bubble(timeline, num_stages)
"""
PICK_FROM_RING_WALK = """\
import math
from llmso_lab.routing import PrefixAware
def bounded_load_pick(ring, key, loads, c):
    walker = PrefixAware.__new__(PrefixAware)
    walker.points, walker.owners = [p for p, _ in ring], [r for _, r in ring]
    cap = math.ceil(c * (sum(loads) + 1) / len(loads))
    return next(r for r in walker.candidates(key) if loads[r] + 1 <= cap)
"""
RECEIVE_THROUGH_THE_STORE = """\
import types, torch
from llmso_lab.engine.attention import TorchAttentionBackend
def write_received_kv(caches, layer, payload, block_table, block_size, start):
    n, (_, _, _, hkv, d) = payload.shape[1], caches[0].shape
    slots = torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)])
    k, v = caches
    backend = types.SimpleNamespace(num_kv_heads=hkv, head_dim=d, latent=False)   # the engine's store, unbound
    TorchAttentionBackend.store_kvcache(backend, payload[0], payload[1], k[layer], v[layer], slots)
"""
MLA_KERNEL_DIRECT = """\
import torch
from llmso_lab.attention.mla import absorb_query
from llmso_lab.attention.triton_mla import (_mla_decode_kernel, combine_splits, dot_precision, LOG2E, triton)
def mla_decode_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale):
    q = absorb_query(q_nope, q_pe, w_uk).contiguous()                     # [1, H, r + dr]
    S, r = c_kv.shape
    cache = torch.cat([c_kv, k_pe], -1).contiguous()[:, None, None, :]    # S blocks of one slot
    B, H, D = q.shape
    tables = torch.arange(S, dtype=torch.int32)[None]
    lens = torch.tensor([S], dtype=torch.int32)
    o_part, lse_part = torch.empty(H, r), torch.empty(H)
    _mla_decode_kernel[(1, 1)](q, cache, tables, lens, o_part, lse_part, q.stride(0), q.stride(1), cache.stride(0),
                               cache.stride(1), tables.stride(0), scale * LOG2E, H, r, D, 1, PAGE_SIZE=1,
                               PRECISION=dot_precision(q.dtype), BLOCK_H=max(16, triton.next_power_of_2(H)),
                               BLOCK_N=16, BLOCK_D=max(16, triton.next_power_of_2(D)))
    o = combine_splits(o_part, lse_part, 1, H, 1, q.dtype)[0]
    return torch.einsum("bhr,hvr->bhv", o, w_uv)
"""


@pytest.mark.parametrize("lab,name,source,before", [
    ("08", "tp_mlp_forward", TP_FROM_ENGINE, 30), ("08", "bubble_fraction", BUBBLE_FROM_MEASURE, 5),
    ("04", "bounded_load_pick", PICK_FROM_RING_WALK, 20), ("09", "write_received_kv", RECEIVE_THROUGH_THE_STORE, 40),
    ("05", "mla_decode_absorbed", MLA_KERNEL_DIRECT, 40)],
    ids=["tp-engine-op", "bubble-helper", "ring-walk", "kv-store", "triton-kernel"])
def test_class5_what_computes_the_answer_in_the_library_is_disabled(tmp_path, lab, name, source, before):
    """Before: `before` points (full marks: the engine's TP shard and MLP op, the measured-bubble helper, the
    router's candidate walk, the engine's K/V store and the MLA Triton kernel launched directly were not disabled).
    After: the library path trips, so no case that reaches it passes."""
    tests, _ = graded(tmp_path, lab, {f"lab{lab}/{name}": source}, only=[name])
    t = tests[name]
    assert t["score"] < before / 2 and "TRIPWIRE" in t["output"], t["output"]


def test_class5_check_trips_on_the_library_path_but_the_harness_keeps_it():
    """check() runs the harness in the notebook's process: the tripwires are armed only inside the student's code,
    so the router's candidate walk trips in the submission while route_stream itself still walks the ring."""
    res = check("bounded_load_pick", run_cell(PICK_FROM_RING_WALK, "bounded_load_pick"))
    assert res.passed == 0 and "TRIPWIRE" in repr(res), repr(res)
    assert get_exercise("bounded_load_pick").harness == "llmso_lab.routing:route_stream"


# ---- grade properties, not one implementation -------------------------------------------------------------------
def test_a_share_is_recognised_whatever_features_a_rank_owns():
    """share_features recovers the features a partial sum is made of: contiguous, strided and permuted partitions
    are shares; the whole MLP / tp, a partial with one feature twice, and a slightly wrong one are not."""
    x, gate, up, down = tp_mlp_case(2, num_tokens=5, hidden=16, intermediate=24, seed=0)
    act = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
    tol = 1e-5 * float((act.abs() @ down.abs().t()).max())

    def partial(idx):
        return act[:, idx] @ down[:, idx].t()

    for idx in ([0, 1, 2, 3, 4, 5], [1, 5, 9, 13, 17, 21], [23, 0, 7, 11, 2, 19]):
        assert share_features(act, down, partial(torch.tensor(idx)), tol) == sorted(idx)
    assert share_features(act, down, (act @ down.t()) / 4, tol) is None
    assert share_features(act, down, partial(torch.tensor([0, 0, 1])), tol) is None
    assert share_features(act, down, partial(torch.tensor([0, 1])) * 1.001, tol) is None


def test_the_tp_report_grades_a_strided_partition_and_refuses_overlap():
    x, gate, up, down = tp_mlp_case(2, seed=3)
    act = torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())
    full = act @ down.t()
    shares = [act[:, r::2] @ down[:, r::2].t() for r in range(2)]
    good = tp_mlp_report(x, gate, up, down, [full, full], [[shares[0]], [shares[1]]])
    assert good["partial_is_rank_share"] and good["output_equals_tp1"] and good["all_reduces_per_rank"] == [1, 1]
    overlap = tp_mlp_report(x, gate, up, down, [full, full], [[shares[0]], [shares[0]]])
    assert not overlap["partial_is_rank_share"]


# ---- the grader's collectives -----------------------------------------------------------------------------------
def test_star_all_reduce_sums_in_rounds_and_fails_a_rank_that_skips_one():
    star = StarAllReduce(2)
    assert star.request(0, "all_reduce", [torch.ones(2)]) == []
    out = star.request(1, "all_reduce", [torch.full((2,), 2.0)])
    assert [r for r, _ in out] == [0, 1] and all(torch.equal(v, torch.full((2,), 3.0)) for _, v in out)
    assert star.request(0, "all_reduce", [torch.ones(2)]) == []
    failed = star.finished(1)   # rank 1 returns after one all-reduce while rank 0 waits in its second
    assert [r for r, _ in failed] == [0] and isinstance(failed[0][1], RuntimeError)
    assert [len(s) for s in star.sent] == [2, 1]
    assert isinstance(star.request(0, "all_reduce", ["not a tensor"])[0][1], TypeError)


def test_logical_pipeline_stamps_messages_and_blocks_recv_until_a_send():
    pipe = LogicalPipeline(2, rows=1, hidden=2, seed=0)
    x = torch.ones(1, 2)
    assert pipe.request(1, "recv", [0]) == []          # nothing sent yet: stage 1 waits
    (r0, y), = pipe.request(0, "compute", [x])
    assert r0 == 0 and y.shape == (1, 2)
    delivered = pipe.request(0, "send", [y, 1])         # stage 0's clock is 1 when it sends
    assert [r for r, _ in delivered] == [0, 1] and pipe.clock[1] == 1.0
    pipe.request(1, "compute", [y])
    assert pipe.logical == [[(0.0, 1.0)], [(1.0, 2.0)]]
    assert isinstance(pipe.request(0, "send", [y, 0])[0][1], ValueError)    # to itself
    assert isinstance(pipe.request(0, "compute", [torch.ones(3, 3)])[0][1], ValueError)


def test_mlp_weights_are_seeded():
    assert all(torch.equal(a, b) for a, b in zip(mlp_weights(8, 16, 1), mlp_weights(8, 16, 1)))

