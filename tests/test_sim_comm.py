"""Communication cost model (lecture 2-2): collective formulas against a message-by-message ring simulation, the
lecture's numbers, TP / PP / DP / EP step times against hand-built references, the plan's advice, link fitting,
and one gloo measurement."""
import math
import random

import pytest
from matplotlib.figure import Figure

from llmso_lab import hardware as hw
from llmso_lab.hardware import LINKS, Link
from llmso_lab.models.shapes import DEEPSEEK_V3, LLAMA3_70B, LLAMA3_8B, SMOLLM2_135M, ModelShape
from llmso_lab.sim import comm
from llmso_lab.sim.comm import Layout, Topology
from llmso_lab.sim.cost import StepCost

LINK = Link("test", 1e9, 1e-5)   # 1 GB/s, 10 us: easy numbers by hand
H100 = hw.ACCELERATORS["H100-SXM"]


# ---- collectives ------------------------------------------------------------------------------------------------
def ring_allreduce_by_messages(values: list[list[float]], link: Link, elem_bytes: int) -> tuple[list[list[float]], float]:
    """Brute force: run a ring all-reduce chunk by chunk (reduce-scatter, then all-gather), every rank sending one
    chunk to its right neighbour per step; time = steps x (latency + chunk bytes / bandwidth)."""
    n, size = len(values), len(values[0])
    chunks = [[v[i * size // n:(i + 1) * size // n] for i in range(n)] for v in values]
    elapsed = 0.0
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            sends = []
            for r in range(n):   # which chunk rank r sends this step
                c = (r - step) % n if phase == "reduce-scatter" else (r + 1 - step) % n
                sends.append((r, c, list(chunks[r][c])))
            for r, c, data in sends:
                dst = (r + 1) % n
                chunks[dst][c] = [a + b for a, b in zip(chunks[dst][c], data)] if phase == "reduce-scatter" else data
            elapsed += link.latency + max(len(d) for _, _, d in sends) * elem_bytes / link.bandwidth
    return [[x for ch in rank for x in ch] for rank in chunks], elapsed


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_allreduce_formula_matches_a_message_by_message_ring(n):
    rng = random.Random(n)
    values = [[rng.randint(-9, 9) for _ in range(12 * n)] for _ in range(n)]
    out, elapsed = ring_allreduce_by_messages(values, LINK, elem_bytes=4)
    total = [sum(col) for col in zip(*values)]
    assert all(rank == total for rank in out)                         # the simulation really all-reduces
    assert comm.allreduce_time(12 * n * 4, n, LINK) == pytest.approx(elapsed, rel=1e-12)


def test_collective_formulas_hand_computed():
    # 1 MB over 4 ranks at 1 GB/s and 10 us per message
    assert comm.allreduce_time(1e6, 4, LINK) == pytest.approx(2 * 3 / 4 * 1e-3 + 6 * 1e-5)   # 1.56 ms
    assert comm.allgather_time(1e6, 4, LINK) == pytest.approx(3 / 4 * 1e-3 + 3 * 1e-5)
    assert comm.all_to_all_time(1e6, 4, LINK) == pytest.approx(3 / 4 * 1e-3 + 3 * 1e-5)
    assert comm.send_time(1e6, LINK) == pytest.approx(1e-5 + 1e-3)
    assert comm.allreduce_time(1e6, 1, LINK) == comm.allgather_time(1e6, 1, LINK) == comm.all_to_all_time(1e6, 1, LINK) == 0
    # latency-bound when small: 160 all-reduces of one 70B token (16 KB) over 8 NVLink GPUs ~ 160 x 14 us
    nv = LINKS["NVLink4"]
    t = comm.allreduce_time(8192 * 2, 8, nv)
    assert 14 * nv.latency < t < 15 * nv.latency


def test_links_table():
    gb = {name: link.bandwidth / 1e9 for name, link in LINKS.items()}
    assert gb == {"NVLink4": 450, "NVLink3": 300, "PCIe5": 64, "PCIe4": 32, "IB-NDR": 50, "100GbE": 12.5, "25GbE": 3.125}
    lat = {name: link.latency for name, link in LINKS.items()}
    assert lat["NVLink4"] <= lat["PCIe5"] <= lat["IB-NDR"] < lat["100GbE"] and 1e-7 < lat["NVLink4"] and lat["25GbE"] < 1e-3
    assert hw.get_link("ib-ndr") is LINKS["IB-NDR"]
    assert LINKS["100GbE"].transfer_time(12.5e9) == pytest.approx(1 + 30e-6)
    with pytest.raises(ValueError, match="known: NVLink4"):
        hw.get_link("carrier pigeon")
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link("bad", 0, 1e-6)


# ---- the lecture's numbers ----------------------------------------------------------------------------------------
def test_lecture_numbers():
    assert comm.tp_allreduces_per_token(80) == 160 and comm.tp_allreduces_per_token(30) == 60   # SmolLM2: 30 layers
    assert LLAMA3_70B.weight_bytes(2) / 1e9 == pytest.approx(141.1, abs=0.1)                     # "70B FP16 ~ 140GB"
    assert comm.min_gpus(LLAMA3_70B, "H100-SXM") == 2                                            # does not fit one
    assert comm.min_gpus(LLAMA3_70B, H100, 1) == 1                                               # fp8 fits one
    assert LLAMA3_70B.kv_bytes_per_token(2) == hw.kv_bytes_per_token(80, 8, 128, 2) == 327_680   # "~320KB"
    # KV headroom: 32 sequences of 8K tokens (86 GB) beside the weights -> 3 GPUs at full memory, 4 at 90%
    kv = 32 * 8192
    assert comm.min_gpus(LLAMA3_70B, H100, 2, kv) == math.ceil((LLAMA3_70B.weight_bytes(2) + kv * 327_680) / 80e9) == 3
    assert comm.min_gpus(LLAMA3_70B, H100, 2, kv, gpu_memory_utilization=0.9) == 4
    # disaggregation: 8K tokens of KV (2.7 GB) over 400 Gb/s: "50ms 남짓"
    assert 0.050 < comm.kv_transfer_time(LLAMA3_70B, 8192, LINKS["IB-NDR"]) < 0.060
    # PP sends one activation per token, TP all-reduces 160 of them: "통신량이 TP보다 훨씬 적고"
    assert comm.tp_comm_bytes_per_step(LLAMA3_70B, 8, 1) == 160 * 8192 * 2
    assert comm.tp_comm_bytes_per_step(LLAMA3_70B, 1, 100) == 0
    assert comm.tp_comm_bytes_per_step(SMOLLM2_135M, 3, 10, 4) == 60 * 10 * 576 * 4


def gpipe_idle_fraction(p: int, m: int) -> float:
    """Brute force: stage s runs micro-batch j in slot s + j; count the idle (stage, slot) cells."""
    slots = m + p - 1
    busy = {(s, s + j) for s in range(p) for j in range(m)}
    return 1 - len(busy) / (p * slots)


@pytest.mark.parametrize("p,m", [(1, 1), (2, 1), (4, 1), (4, 4), (3, 8), (8, 2)])
def test_pipeline_bubble_is_gpipe(p, m):
    assert comm.pipeline_bubble(p, m) == pytest.approx(gpipe_idle_fraction(p, m))


# ---- one parallel step ---------------------------------------------------------------------------------------------
def test_tp_step_equals_the_hand_sharded_model_plus_all_reduces():
    """TP=4 in one node: compute = StepCost of a model with a quarter of every matrix; comm = 2L ring all-reduces."""
    cost = StepCost(H100, LLAMA3_8B)
    batch, ctx, tp = 16, 1000, 4
    s = LLAMA3_8B
    quarter = ModelShape("8B/4", s.num_layers, s.hidden_size, s.num_heads // tp, s.num_kv_heads // tp, s.head_dim,
                         s.intermediate_size // tp, s.vocab_size // tp)
    step = comm.decode_step(cost, Topology(4, 1, LINK, LINK), Layout(tp=tp), batch, ctx)
    assert step.compute_s == pytest.approx(StepCost(H100, quarter).step_time(decode=[ctx] * batch), rel=2e-3)
    per = 2 * (tp - 1) / tp * batch * s.hidden_size * 2 / LINK.bandwidth + 2 * (tp - 1) * LINK.latency
    assert step.tp_comm_s == pytest.approx(2 * s.num_layers * per)
    assert step.time_s == pytest.approx(step.compute_s + step.tp_comm_s) and step.send_s == 0 and step.bubble == 0
    assert step.tokens_per_s == pytest.approx(batch / step.time_s) and step.tp_link == "test"


def test_pp_step_stage_share_sends_and_in_flight():
    cost = StepCost(H100, LLAMA3_70B)
    intra, inter = Link("intra", 400e9, 1e-6), Link("inter", 10e9, 50e-6)
    topo = Topology(2, 2, intra, inter)
    one = comm.decode_step(cost, topo, Layout(), 8, 512)
    # pp=4 over 4 GPUs: boundaries 0|1 intra, 1|2 across nodes, 2|3 intra; each sends a [2 seqs, hidden] activation
    for m in (1, 2, 4, 8):
        st = comm.decode_step(cost, topo, Layout(pp=4), 8, 512, in_flight=m)
        per_mb = 8 // m
        assert st.compute_s == pytest.approx(comm.decode_step(cost, topo, Layout(), per_mb, 512).compute_s / 4)
        act = per_mb * 8192 * 2
        assert st.send_s == pytest.approx(2 * intra.transfer_time(act) + inter.transfer_time(act))
        assert st.time_s == pytest.approx(max(m, 4) * st.stage_s + st.send_s)
        assert st.bubble == pytest.approx(max(0, 4 - m) / 4) and st.tokens == 8
    assert comm.decode_step(cost, topo, Layout(pp=4), 8, 512, in_flight=1).pp_link == "inter"
    # uneven split: the slowest stage has ceil(80 / 3) = 27 layers
    three = comm.decode_step(cost, Topology(3, 1, intra, intra), Layout(pp=3), 8, 512, in_flight=1)
    assert three.compute_s == pytest.approx(one.compute_s * 27 / 80)
    # GPipe prefill: (m + p - 1) stage slots, bubble (p - 1) / (m + p - 1)
    pre = comm.prefill_step(cost, topo, Layout(tp=2, pp=2), 8, 256, micro_batches=4)
    assert pre.time_s == pytest.approx(5 * pre.stage_s + pre.send_s) and pre.bubble == pytest.approx(1 / 5)
    assert pre.send_s == pytest.approx(inter.transfer_time(2 * 256 * 8192 * 2)) and pre.tokens == 8 * 256
    assert pre.tp_link == "intra" and pre.pp_link == "inter"


def test_placement_tp_fastest_then_pp_then_dp():
    intra, inter = LINKS["NVLink4"], LINKS["100GbE"]
    topo = Topology(4, 2, intra, inter)
    assert [Layout(tp=2, pp=2, dp=2).gpu(t, s, r) for r in range(2) for s in range(2) for t in range(2)] == list(range(8))
    assert Layout(tp=4, pp=2).tp_link(topo) is intra and Layout(tp=4, pp=2).pp_links(topo) == [inter]
    assert Layout(tp=8).tp_link(topo) is inter and Layout(tp=1).tp_link(topo) is None
    assert Layout(tp=2, pp=2, dp=2).pp_links(topo) == [intra] and Layout(tp=2, dp=4).tp_link(topo) is intra
    assert Layout(pp=8).pp_links(topo) == [intra] * 3 + [inter] + [intra] * 3


def test_kv_heads_stop_splitting_past_num_kv_heads():
    """Llama-3-70B at TP 16: KV heads are replicated, so KV reads per GPU equal TP 8's (`parallel.heads`)."""
    cost = StepCost(H100, LLAMA3_70B)
    topo = Topology(16, 1, LINK, LINK)
    kv_time = {tp: comm.decode_step(cost, topo, Layout(tp=tp), 64, 32_000).compute_s
               - comm.decode_step(cost, topo, Layout(tp=tp), 64, 1).compute_s for tp in (8, 16)}
    # weights halve from 8 to 16, KV does not: the context-dependent part stays the same
    assert kv_time[16] == pytest.approx(kv_time[8], rel=1e-6) and kv_time[8] > 0


# ---- the lecture's advice -----------------------------------------------------------------------------------------
def rows_by_plan(**kw) -> dict[str, dict]:
    return {r["plan"]: r for r in comm.plan(**kw)}


@pytest.mark.parametrize("batch", [1, 64])
def test_plan_reproduces_the_lecture_advice(batch):
    ib = rows_by_plan(topology=Topology.of(8, 2, "NVLink4", "IB-NDR"), batch=batch)
    eth = rows_by_plan(topology=Topology.of(8, 2, "NVLink4", "100GbE"), batch=batch)
    tp, pp, tppp = "TP only", "PP only", "TP in node x PP across nodes"
    for rows in (ib, eth):
        assert rows[tp]["tp_link"] != "NVLink4" and rows[tppp]["tp_link"] == "NVLink4"
        # one big model over 16 GPUs: TP in the node x PP across nodes beats TP-only and PP-only, both ways
        assert rows[tppp]["tpot_ms"] < min(rows[tp]["tpot_ms"], rows[pp]["tpot_ms"])
        assert rows[tppp]["tokens_per_s"] > max(rows[tp]["tokens_per_s"], rows[pp]["tokens_per_s"])
        assert rows[tppp]["send_ms"] < 0.05 * rows[tppp]["tpot_ms"]          # PP's sends are cheap even across nodes
    # TP across an Ethernet link loses badly: all-reduces dominate, >10x slower per token than TP-in-node x PP
    assert eth[tp]["tpot_ms"] > 10 * eth[tppp]["tpot_ms"] and eth[tp]["tp_comm_ms"] > 0.9 * eth[tp]["tpot_ms"]
    assert eth[tp]["tpot_ms"] > 3 * ib[tp]["tpot_ms"]
    assert all(r["fits"] for r in ib.values())


def test_plan_prefers_replicas_when_the_model_fits_one_node():
    eth = Topology.of(8, 2, "NVLink4", "100GbE")
    dp, tppp = "DP replicas (one per node)", "TP in node x PP across nodes"
    full = rows_by_plan(topology=eth, batch=64)                   # pipeline kept full: DP still ahead by the sends
    assert full[dp]["tokens_per_s"] > full[tppp]["tokens_per_s"] and full[dp]["pp_link"] == "-"
    low = rows_by_plan(topology=eth, batch=64, in_flight=1)       # low concurrency: PP's bubble shows
    assert low[tppp]["bubble"] == 0.5 and low[dp]["tokens_per_s"] > 1.1 * low[tppp]["tokens_per_s"]
    # nodes of two H100s cannot hold 70B + KV: one replica per node does not fit, TP2 x PP4 does
    small = rows_by_plan(topology=Topology.of(2, 4), batch=64, context_len=2048)
    assert not small[dp]["fits"] and small[tppp]["fits"]   # 16 sequences per replica, KV split over TP 2:
    assert small[dp]["gpu_mem_GB"] == pytest.approx((LLAMA3_70B.weight_bytes() + 16 * LLAMA3_70B.kv_cache_bytes(2048)) / 2 / 1e9)


def test_decision_chart_tp_needs_nvlink():
    rows = comm.tp_link_table(tps=(2, 4, 8), batch=1)
    t = {(r["link"], r["tp"]): r["tpot_ms"] for r in rows}
    assert len(rows) == 3 * len(LINKS)
    nv_gain, pcie_gain = t["NVLink4", 4] / t["NVLink4", 8], t["PCIe4", 4] / t["PCIe4", 8]
    assert nv_gain > 1.4 and pcie_gain < 1.2                      # "PCIe만으로 TP=8 ... 늘린 만큼 안 빨라집니다"
    assert t["100GbE", 8] > t["100GbE", 2]                         # over Ethernet more TP is slower
    # batch 1 is latency-bound: 25 GbE (4x less bandwidth, same latency) costs 100 GbE little
    assert t["25GbE", 8] < 1.05 * t["100GbE", 8]
    big = {(r["link"], r["tp"]): r["comm_ms"] for r in comm.tp_link_table(tps=(8,), batch=256)}
    assert big["25GbE", 8] > 2 * big["100GbE", 8]                   # big batches: bandwidth matters
    fig = comm.plot_tp_link_chart(rows)
    assert isinstance(fig, Figure) and len(fig.axes[0].lines) == 3


def test_expert_parallel_all_to_all():
    # hand-computed: 2 MoE layers x (dispatch + combine), 10 tokens x top-2 x hidden 64 x 2 bytes per rank, 4 ranks
    moe = ModelShape("moe", 2, 64, 4, 4, 16, 128, 100, num_experts=8, experts_per_token=2)
    per = 10 * 2 * 64 * 2
    assert comm.ep_dispatch_bytes(10, 2, 64) == per
    assert comm.ep_comm_time(moe, 4, 10, LINK) == pytest.approx(2 * 2 * (3 / 4 * per / 1e9 + 3e-5))
    # DeepSeek-V3 in fp8 on 8 H200s: the all-to-alls are the main cost over Ethernet, small over NVLink
    cost = StepCost(hw.ACCELERATORS["H200"], DEEPSEEK_V3, dtype_bytes=1)
    steps = {name: comm.ep_decode_step(cost, 8, LINKS[name], 64, 2048) for name in ("NVLink4", "IB-NDR", "100GbE")}
    assert steps["NVLink4"].comm_s < 0.1 * steps["NVLink4"].compute_s < steps["IB-NDR"].comm_s
    assert steps["100GbE"].comm_s > steps["100GbE"].compute_s
    assert len({s.compute_s for s in steps.values()}) == 1 and steps["NVLink4"].tokens_per_s > steps["100GbE"].tokens_per_s


# ---- fitting and measuring a link ----------------------------------------------------------------------------------
def test_fit_link_recovers_latency_and_bandwidth():
    sizes = [4, 1 << 10, 1 << 16, 1 << 20, 1 << 24]
    exact = comm.fit_link([(b, 20e-6 + b / 2e9) for b in sizes])
    assert exact.latency == pytest.approx(20e-6, rel=1e-9) and exact.bandwidth == pytest.approx(2e9, rel=1e-9)
    rng = random.Random(0)
    noisy = comm.fit_link([(b, (20e-6 + b / 2e9) * (1 + rng.uniform(-0.02, 0.02))) for b in sizes for _ in range(3)])
    assert noisy.latency == pytest.approx(20e-6, rel=0.05) and noisy.bandwidth == pytest.approx(2e9, rel=0.05)
    link = Link("ref", 5e9, 40e-6)   # all-reduce timings of a 4-rank ring give back the link
    fitted = comm.link_from_allreduce([(b, comm.allreduce_time(b, 4, link)) for b in sizes], 4)
    assert fitted.latency == pytest.approx(40e-6) and fitted.bandwidth == pytest.approx(5e9)
    pts = [(b, -1e-4 + b / 1e9) for b in (2e5, 1e6, 4e6)]
    clamped = comm.fit_link(pts)      # intercept < 0 -> latency 0, then t = b / bw through the origin, relative errors
    ratios = [b / t for b, t in pts]
    assert clamped.latency == 0 and clamped.bandwidth == pytest.approx(sum(r * r for r in ratios) / sum(ratios))


def test_measure_gloo_link_on_this_machine():
    link = comm.measure_gloo_link(world_size=2, budget_s=0.1)    # one launch
    assert math.isfinite(link.latency) and math.isfinite(link.bandwidth)
    assert 0 < link.latency < 0.1 and 1e6 < link.bandwidth < 1e12
    assert comm.allreduce_time(1 << 22, 2, link) > comm.allreduce_time(4, 2, link) > 0


# ---- errors --------------------------------------------------------------------------------------------------------
def test_bad_input_is_refused_with_a_hint():
    cost = StepCost(H100, LLAMA3_70B)
    topo = Topology.of(8, 2)
    cases = [
        (lambda: comm.allreduce_time(-1, 2, LINK), "nbytes must be >= 0"),
        (lambda: comm.allreduce_time(10, 0, LINK), "int >= 1"),
        (lambda: comm.all_to_all_time(10, 2, "NVLink4"), "hardware.Link"),
        (lambda: comm.tp_allreduces_per_token(0), "num_layers"),
        (lambda: comm.pipeline_bubble(0, 4), "num_stages"),
        (lambda: Layout(tp=0), "tp, pp and dp"),
        (lambda: Topology(8, 2, LINK, "IB"), "Topology.of"),
        (lambda: comm.decode_step(cost, topo, Layout(tp=3), 8, 100), "valid sizes for 64 query / 8 KV heads"),
        (lambda: comm.decode_step(cost, topo, Layout(tp=8, pp=4), 8, 100), "needs 32 GPUs"),
        (lambda: comm.decode_step(cost, Topology.of(128, 1), Layout(pp=81), 8, 100), "81 stages > 80 layers"),
        (lambda: comm.decode_step(cost, topo, Layout(), 0, 100), "batch must be"),
        (lambda: comm.plan(batch=0), "batch must be"),
        (lambda: comm.plan(layouts=[("odd TP", Layout(tp=3))]), "valid sizes"),
        (lambda: comm.decode_step(cost, topo, Layout(pp=2), 8, 100, in_flight=0), "micro_batches"),
        (lambda: comm.prefill_step(cost, topo, Layout(), 8, 0), "prompt_len"),
        (lambda: comm.ep_comm_time(LLAMA3_70B, 8, 10, LINK), "dense model"),
        (lambda: comm.ep_decode_step(StepCost(H100, DEEPSEEK_V3), 7, LINK, 64, 10), "dividing 256 experts"),
        (lambda: comm.min_gpus(LLAMA3_70B, H100, gpu_memory_utilization=0), "gpu_memory_utilization"),
        (lambda: comm.min_gpus(LLAMA3_70B, hw.Accelerator("cpu", 1e12, 1e11, 0, "none", 0, 0)), "no memory figure"),
        (lambda: comm.fit_link([(10, 1e-3)]), "two points"),
        (lambda: comm.fit_link([(10, 2e-3), (20, 1e-3)]), "do not grow"),
        (lambda: comm.link_from_allreduce([(10, 1e-3), (20, 2e-3)], 1), "n >= 2"),
        (lambda: comm.measure_gloo_allreduce(world_size=1), "world_size"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
