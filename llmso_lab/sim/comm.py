"""Communication cost of multi-GPU serving (lecture 2-2): collectives over a `Link`, and what TP, PP, EP and DP
add to a decode or prefill step.

The alpha-beta model: one message of b bytes over a link takes `latency + b / bandwidth`. Collectives are made
of such messages; the ring algorithms below are what NCCL and gloo run on large tensors (Patarasuk & Yuan 2009,
Thakur et al. 2005). Each formula counts the messages on the critical path (each costs one `latency`) and the
bytes one rank sends (each costs `1 / bandwidth`; a rank sends and receives at once, and `Link.bandwidth` is per
direction).

Placement (`Layout` on a `Topology`): GPU g sits in node g // gpus_per_node, and a replica numbers its ranks TP
fastest, then PP, then DP (as vLLM and Megatron do), so a TP group fills consecutive GPUs of a node. A group that
spans two nodes runs at the inter-node link's speed: a ring is as slow as its slowest hop.

What it leaves out, on purpose: compute and communication never overlap; the embedding's and LM head's vocab-
parallel collectives are not counted (the lecture's "2 all-reduces per layer"); the embedding and head are spread
over the stages with the layers; NCCL's tree / NVLS algorithms, which beat the ring on small messages, are not
modelled. Units: bytes, seconds, bytes/s.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from llmso_lab.hardware import LINKS, Accelerator, Link, get_accelerator, get_link
from llmso_lab.models.shapes import LLAMA3_70B, ModelShape
from llmso_lab.parallel.heads import shard_heads
from llmso_lab.sim.cost import StepCost

__all__ = [
    "send_time", "allreduce_time", "allgather_time", "all_to_all_time",
    "tp_allreduces_per_token", "tp_comm_bytes_per_step", "pipeline_bubble", "ep_dispatch_bytes", "ep_comm_time",
    "kv_transfer_time", "min_gpus",
    "Topology", "Layout", "ParallelStep", "decode_step", "prefill_step", "EPStep", "ep_decode_step", "TPCost",
    "plan", "tp_link_table", "plot_tp_link_chart",
    "fit_link", "link_from_allreduce", "measure_gloo_allreduce", "measure_gloo_link",
]


# ---- collectives ----------------------------------------------------------------------------------------------
def _check(nbytes: float, n: int, link: Link) -> None:
    if not isinstance(link, Link):
        raise ValueError(f"link must be a hardware.Link (e.g. hardware.LINKS['NVLink4']), got {link!r}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of ranks must be an int >= 1, got {n!r}")


def send_time(nbytes: float, link: Link) -> float:
    """Point-to-point send of `nbytes` bytes (a pipeline stage handing its activations on):
    latency + nbytes / bandwidth."""
    _check(nbytes, 1, link)
    return link.transfer_time(nbytes)


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of an `nbytes` tensor over `n` ranks (every rank ends with the sum):

        2 (n - 1) / n * nbytes / bandwidth  +  2 (n - 1) * latency

    A reduce-scatter then an all-gather, each n - 1 steps in which every rank sends one 1/n chunk to its
    neighbour. The bandwidth term hardly grows with n; the latency term grows linearly, which is why TP's many
    small all-reduces (decode) are latency-bound. 0 for n = 1."""
    _check(nbytes, n, link)
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def allgather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather over `n` ranks, `nbytes` = the gathered tensor (each rank contributes nbytes / n):

        (n - 1) / n * nbytes / bandwidth  +  (n - 1) * latency

    Half an all-reduce. 0 for n = 1."""
    _check(nbytes, n, link)
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """All-to-all over `n` ranks, `nbytes` = what ONE rank sends in total, 1/n of it to each rank (itself included,
    which costs nothing). Pairwise exchange, n - 1 rounds:

        (n - 1) / n * nbytes / bandwidth  +  (n - 1) * latency

    MoE expert parallelism runs two per layer: dispatch (tokens to their experts' ranks) and combine (back).
    0 for n = 1."""
    _check(nbytes, n, link)
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


# ---- what each kind of parallelism sends --------------------------------------------------------------------------
def tp_allreduces_per_token(num_layers: int) -> int:
    """All-reduces tensor parallelism needs for one forward (of any number of tokens): two per layer, after the
    attention output projection and after the MLP down projection (each rank holds a partial sum there).
    80 layers -> 160, the lecture's count."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an int >= 1, got {num_layers!r}")
    return 2 * num_layers


def tp_comm_bytes_per_step(shape: ModelShape, tp: int, num_tokens: int, dtype_bytes: float = 2) -> float:
    """Bytes of the tensors tensor parallelism all-reduces in one forward over `num_tokens` tokens: each of the
    `tp_allreduces_per_token` all-reduces sums a [num_tokens, hidden] activation in `dtype_bytes`. 0 at tp = 1.
    On a ring each rank sends 2 (tp - 1) / tp of this (`allreduce_time`).
    Llama-3-70B, one decode token in bf16: 160 x 8192 x 2 = 2.6 MB."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
    if tp == 1:
        return 0.0
    return tp_allreduces_per_token(shape.num_layers) * num_tokens * shape.hidden_size * dtype_bytes


def pipeline_bubble(num_stages: int, num_microbatches: int) -> float:
    """GPipe's bubble (p - 1) / (m + p - 1): `llmso_lab.parallel.pipeline.bubble_fraction`, where the real pipeline
    measures it."""
    from llmso_lab.parallel.pipeline import bubble_fraction
    return bubble_fraction(num_stages, num_microbatches)


def ep_dispatch_bytes(num_tokens: int, top_k: int, hidden_size: int, dtype_bytes: float = 2) -> float:
    """Bytes one rank sends in ONE MoE all-to-all (dispatch; the combine sends as many back): each of its
    `num_tokens` tokens goes to its `top_k` experts as a [hidden] activation."""
    if min(num_tokens, top_k, hidden_size) < 0 or dtype_bytes <= 0:
        raise ValueError(f"num_tokens, top_k, hidden_size must be >= 0 and dtype_bytes > 0, got "
                         f"{num_tokens}, {top_k}, {hidden_size}, {dtype_bytes}")
    return num_tokens * top_k * hidden_size * dtype_bytes


def ep_comm_time(shape: ModelShape, ep: int, num_tokens: int, link: Link, dtype_bytes: float = 2) -> float:
    """Expert-parallel communication of one forward: dispatch + combine all-to-all in every MoE layer, each rank
    sending `ep_dispatch_bytes(num_tokens, top_k, hidden)` where `num_tokens` are the tokens ON EACH RANK."""
    if not shape.num_experts:
        raise ValueError(f"{shape.name} is a dense model: expert parallelism needs a MoE shape (num_experts > 0)")
    per_rank = ep_dispatch_bytes(num_tokens, shape.experts_per_token, shape.hidden_size, dtype_bytes)
    return shape.num_moe_layers * 2 * all_to_all_time(per_rank, ep, link)


def kv_transfer_time(shape: ModelShape, num_tokens: int, link: Link, kv_dtype_bytes: float = 2) -> float:
    """Prefill-decode disaggregation: seconds to ship `num_tokens` tokens of KV cache from the prefill GPU to the
    decode GPU in one message. Lecture: 8K tokens of an 80-layer, 8-KV-head model (2.6 GB) over 400 Gb/s ~ 50 ms."""
    return send_time(shape.kv_cache_bytes(num_tokens, 1, kv_dtype_bytes), link)


def min_gpus(shape: ModelShape, accelerator: Accelerator | str, dtype_bytes: float = 2, kv_tokens: int = 0,
             kv_dtype_bytes: float | None = None, gpu_memory_utilization: float = 1.0) -> int:
    """Fewest GPUs whose memory holds the weights plus `kv_tokens` tokens of KV cache (capacity only: it ignores
    activations, and KV heads that TP beyond num_kv_heads replicates). Llama-3-70B in fp16: 141 GB of weights ->
    2 H100-80GB; with KV headroom, more."""
    acc = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    if not acc.mem_bytes:
        raise ValueError(f"{acc.name} has no memory figure; pick a GPU from hardware.ACCELERATORS")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if kv_tokens < 0:
        raise ValueError(f"kv_tokens must be >= 0, got {kv_tokens}")
    need = shape.weight_bytes(dtype_bytes) + kv_tokens * shape.kv_bytes_per_token(kv_dtype_bytes or dtype_bytes)
    return math.ceil(need / (acc.mem_bytes * gpu_memory_utilization))


# ---- where the GPUs are ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Topology:
    """`num_nodes` nodes of `gpus_per_node` GPUs: `intra_node` links GPUs of one node, `inter_node` the nodes
    (per GPU: e.g. one 400 Gb/s NIC per GPU in a DGX H100)."""

    gpus_per_node: int
    num_nodes: int
    intra_node: Link
    inter_node: Link

    def __post_init__(self) -> None:
        if not all(isinstance(x, int) and x >= 1 for x in (self.gpus_per_node, self.num_nodes)):
            raise ValueError(f"gpus_per_node and num_nodes must be ints >= 1, got {self.gpus_per_node!r}, "
                             f"{self.num_nodes!r}")
        if not (isinstance(self.intra_node, Link) and isinstance(self.inter_node, Link)):
            raise ValueError("intra_node and inter_node must be hardware.Link objects (or use Topology.of with names)")

    @classmethod
    def of(cls, gpus_per_node: int, num_nodes: int, intra: str = "NVLink4", inter: str = "IB-NDR") -> "Topology":
        """Build from link names in `hardware.LINKS`."""
        return cls(gpus_per_node, num_nodes, get_link(intra), get_link(inter))

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def link_for(self, gpus: Sequence[int]) -> Link:
        """The link a collective over these GPUs runs at: intra-node if they share a node, else inter-node."""
        return self.intra_node if len({g // self.gpus_per_node for g in gpus}) <= 1 else self.inter_node


@dataclass(frozen=True, slots=True)
class Layout:
    """How one model is spread: `tp` ranks split every layer, `pp` stages split the layers, `dp` replicas of the
    whole thing serve different requests. GPUs used: tp x pp x dp."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if not all(isinstance(x, int) and x >= 1 for x in (self.tp, self.pp, self.dp)):
            raise ValueError(f"tp, pp and dp must be ints >= 1, got {self.tp!r}, {self.pp!r}, {self.dp!r}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def name(self) -> str:
        return f"TP{self.tp} x PP{self.pp} x DP{self.dp}"

    def gpu(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> int:
        """Global GPU index of a rank: TP fastest, then PP, then DP."""
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank

    def check(self, shape: ModelShape, topology: Topology) -> None:
        """ValueError if the layout does not fit the cluster or the model's heads and layers."""
        if self.num_gpus > topology.num_gpus:
            raise ValueError(f"{self.name} needs {self.num_gpus} GPUs; the topology has {topology.num_gpus}")
        if self.pp > shape.num_layers:
            raise ValueError(f"pp={self.pp} stages > {shape.num_layers} layers of {shape.name}")
        if not shape.kv_lora_rank:
            shard_heads(shape.num_heads, shape.num_kv_heads, self.tp)   # raises, listing the valid sizes

    def tp_link(self, topology: Topology) -> Link | None:
        """The link of the slowest TP group (None at tp = 1)."""
        if self.tp == 1:
            return None
        groups = [[self.gpu(t, s, r) for t in range(self.tp)] for s in range(self.pp) for r in range(self.dp)]
        return _slowest([topology.link_for(g) for g in groups])

    def pp_links(self, topology: Topology) -> list[Link]:
        """The link of each of the pp - 1 stage boundaries: stage s's TP rank t sends to stage s + 1's rank t."""
        return [_slowest([topology.link_for((self.gpu(t, s, r), self.gpu(t, s + 1, r)))
                          for t in range(self.tp) for r in range(self.dp)]) for s in range(self.pp - 1)]


def _slowest(links: Sequence[Link]) -> Link:
    return max(links, key=lambda link: (link.transfer_time(1 << 20), link.latency))


# ---- one step of a parallel model -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ParallelStep:
    """Time of one step of a `Layout`. Per micro-batch on the slowest stage: `compute_s` (one GPU's roofline over
    its shard) + `tp_comm_s` (its all-reduces) = `stage_s`; `send_s` sums the pp - 1 activation sends."""

    layout: Layout
    tokens: int           # tokens the step handles, all replicas together (decode: one per sequence)
    micro_batches: int    # per replica
    compute_s: float
    tp_comm_s: float
    send_s: float
    stage_s: float
    time_s: float         # decode: between two tokens of one sequence (TPOT); prefill: the whole batch
    bubble: float         # fraction of the time a stage idles
    tp_link: str          # "-" when unused
    pp_link: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s


def _kv_fraction(shape: ModelShape, tp: int) -> float:
    """Fraction of the model's KV cache one TP rank holds: 1 / tp down to one KV head per rank (`shard_heads`);
    MLA's latent is not per head, so every rank keeps all of it."""
    if shape.kv_lora_rank:
        return 1.0
    return shard_heads(shape.num_heads, shape.num_kv_heads, tp).kv_fraction_per_rank(shape.num_kv_heads)


def _shard_cost(cost: StepCost, layout: Layout, prefill: Sequence[tuple[int, int]], decode: Sequence[int],
                act_bytes: float, topology: Topology) -> tuple[float, float]:
    """(compute_s, tp_comm_s) of one micro-batch on one GPU of the slowest stage: the whole model's FLOPs and
    bytes (`StepCost.work`) times the stage's share of layers, split over the TP ranks. KV heads split only down
    to one per rank (`shard_heads`); MLA's latent is replicated on every TP rank."""
    m = cost.model
    flops, nbytes = cost.work(prefill, decode)
    tokens = sum(n for n, _ in prefill) + len(decode)
    weights = m.weight_bytes_read(tokens, cost.dtype_bytes)
    kv = nbytes - weights
    layers = math.ceil(m.num_layers / layout.pp)
    share = layers / m.num_layers
    compute_s = cost.time_of(flops * share / layout.tp, (weights / layout.tp + kv * _kv_fraction(m, layout.tp)) * share)
    tp_link = layout.tp_link(topology)
    comm = 0.0 if tp_link is None else (
        tp_allreduces_per_token(layers) * allreduce_time(tokens * m.hidden_size * act_bytes, layout.tp, tp_link))
    return compute_s, comm


def _step(cost: StepCost, topology: Topology, layout: Layout, seqs_per_mb: int, prefill_len: int, context_len: int,
          act_bytes: float) -> tuple[float, float, float, str, str]:
    layout.check(cost.model, topology)
    if prefill_len:
        compute, comm = _shard_cost(cost, layout, [(prefill_len, 0)] * seqs_per_mb, (), act_bytes, topology)
        send_bytes = seqs_per_mb * prefill_len * cost.model.hidden_size * act_bytes
    else:
        compute, comm = _shard_cost(cost, layout, (), [context_len] * seqs_per_mb, act_bytes, topology)
        send_bytes = seqs_per_mb * cost.model.hidden_size * act_bytes
    links = layout.pp_links(topology)
    send = sum(send_time(send_bytes, link) for link in links)
    tp_link = layout.tp_link(topology)
    return compute, comm, send, tp_link.name if tp_link else "-", _slowest(links).name if links else "-"


def _per_replica(batch: int, layout: Layout, micro_batches: int | None) -> tuple[int, int]:
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    per_replica = math.ceil(batch / layout.dp)
    m = layout.pp if micro_batches is None else micro_batches
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {m!r}")
    m = min(m, per_replica)   # a micro-batch holds one sequence at least
    return m, math.ceil(per_replica / m)


def decode_step(cost: StepCost, topology: Topology, layout: Layout, batch: int, context_len: int,
                in_flight: int | None = None, act_bytes: float = 2) -> ParallelStep:
    """One decode token for each of `batch` sequences (context `context_len` each), split evenly over the `dp`
    replicas; each replica keeps `in_flight` micro-batches in its pipeline (default: pp, which keeps it full, as
    continuous batching does).

    A micro-batch needs p stage-slots per token; with m in flight the stages take turns, so a sequence gets a
    token every max(m, p) slots:  TPOT = max(m, p) * stage_s + send_s,  and stages idle (p - m) / p of the time
    when m < p (m = 1: the lecture's exposed bubble at low concurrency)."""
    m, per_mb = _per_replica(batch, layout, in_flight)
    compute, comm, send, tl, pl = _step(cost, topology, layout, per_mb, 0, context_len, act_bytes)
    stage = compute + comm
    p = layout.pp
    return ParallelStep(layout, batch, m, compute, comm, send, stage, max(m, p) * stage + send,
                        max(0, p - m) / p, tl, pl)


def prefill_step(cost: StepCost, topology: Topology, layout: Layout, batch: int, prompt_len: int,
                 micro_batches: int = 1, act_bytes: float = 2) -> ParallelStep:
    """Prefill of `batch` prompts of `prompt_len` tokens, split over the `dp` replicas, each replica's share cut
    into `micro_batches` micro-batches of whole prompts that flow through an empty pipeline (GPipe):
    time = (m + p - 1) * stage_s + send_s, bubble = `pipeline_bubble(p, m)`."""
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
    m, per_mb = _per_replica(batch, layout, micro_batches)
    compute, comm, send, tl, pl = _step(cost, topology, layout, per_mb, prompt_len, 0, act_bytes)
    stage = compute + comm
    p = layout.pp
    return ParallelStep(layout, batch * prompt_len, m, compute, comm, send, stage, (m + p - 1) * stage + send,
                        pipeline_bubble(p, m), tl, pl)


@dataclass(frozen=True, slots=True)
class EPStep:
    """One decode step of a MoE model under expert parallelism with data-parallel attention (DeepSeek-style):
    each of `ep` ranks runs attention for its own sequences with replicated attention weights, and holds
    num_experts / ep whole experts."""

    ep: int
    tokens: int
    compute_s: float      # one rank's roofline time
    comm_s: float         # dispatch + combine all-to-alls of every MoE layer
    time_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s


def ep_decode_step(cost: StepCost, ep: int, link: Link, batch: int, context_len: int,
                   act_bytes: float = 2) -> EPStep:
    """Decode step of `batch` sequences spread over `ep` ranks (`EPStep`). A rank reads the non-expert weights,
    its 1/ep of the experts the whole batch touches (uniform routing), and its sequences' KV; it does its own
    tokens' FLOPs (routing balanced on average). Each MoE layer adds `ep_comm_time`'s two all-to-alls."""
    m = cost.model
    if not m.num_experts:
        raise ValueError(f"{m.name} is a dense model: expert parallelism needs a MoE shape (num_experts > 0)")
    if not isinstance(ep, int) or ep < 1 or m.num_experts % ep:
        raise ValueError(f"ep must be an int >= 1 dividing {m.num_experts} experts, got {ep!r}")
    if not isinstance(batch, int) or batch < ep:
        raise ValueError(f"batch must be an int >= ep={ep} (one sequence per rank at least), got {batch!r}")
    local = math.ceil(batch / ep)
    flops, nbytes = cost.work((), [context_len] * local)
    kv = nbytes - m.weight_bytes_read(local, cost.dtype_bytes)
    routed = m.num_experts * m.expert_params * m.num_moe_layers * cost.dtype_bytes
    dense = m.weight_bytes(cost.dtype_bytes) - routed
    touched = m.weight_bytes_read(batch, cost.dtype_bytes) - dense
    compute = cost.time_of(flops, dense + touched / ep + kv)
    comm = ep_comm_time(m, ep, local, link, act_bytes)
    return EPStep(ep, batch, compute, comm, compute + comm)


# ---- one serving instance as a TP group: a cost model for the simulators ------------------------------------------
@dataclass(slots=True)
class TPCost:
    """A cost model (`sim.cost.CostModel`) for an instance of `tp` GPUs joined by `link`: one rank's roofline over
    its shard plus the all-reduces of every layer, for any mix of prefill and decode. It is `sim.comm`'s TP model
    (`_shard_cost`, which tests compare it with) with the model's constants computed once: the PD simulator
    (`sim.disagg`) calls it every step."""

    cost: StepCost                          # one GPU running the whole model
    tp: int = 1
    link: Link = LINKS["NVLink4"]
    act_bytes: float = 2                    # bytes per activation element in the all-reduces
    _k: tuple = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        m = self.cost.model
        Layout(tp=self.tp).check(m, Topology(self.tp, 1, self.link, self.link))   # the heads must split tp ways
        dense = None if m.num_experts else m.weight_bytes_read(1, self.cost.dtype_bytes)
        self._k = (2 * m.body_matmul_params(), 2 * m.head_params, m.attention_flops(1), dense,
                   self.cost.kv_bytes_per_token * _kv_fraction(m, self.tp), tp_allreduces_per_token(m.num_layers))

    @property
    def model(self) -> ModelShape:
        return self.cost.model

    @property
    def kv_bytes_per_token(self) -> int:
        """The whole model's KV bytes per token (all ranks together)."""
        return self.cost.kv_bytes_per_token

    def step_time(self, prefill: Sequence[tuple[int, int]] = (), decode: Sequence[int] = ()) -> float:
        """Seconds of one step (`StepCost.work`'s counts: `prefill` (new, cached) chunks, `decode` contexts)."""
        if not prefill and not decode:
            return 0.0
        tokens = sum(n for n, _ in prefill) + len(decode)
        pairs = sum(n * p + n * (n + 1) // 2 for n, p in prefill) + sum(decode)     # query-key pairs
        kv_tokens = sum(n + p for n, p in prefill) + sum(decode)
        return self._time(tokens, len(prefill) + len(decode), pairs, kv_tokens)

    def decode_time(self, num_seqs: int, sum_context: int) -> float:
        """A decode step from its totals: `num_seqs` sequences whose contexts sum to `sum_context`."""
        return self._time(num_seqs, num_seqs, sum_context, sum_context) if num_seqs else 0.0

    def _time(self, tokens: int, seqs: int, pairs: int, kv_tokens: int) -> float:
        body2, head2, attn1, dense, kv_rank, num_ar = self._k
        flops = body2 * tokens + head2 * seqs + attn1 * pairs
        weights = dense if dense is not None else self.model.weight_bytes_read(tokens, self.cost.dtype_bytes)
        compute = self.cost.time_of(flops / self.tp, weights / self.tp + kv_tokens * kv_rank)
        if self.tp == 1:
            return compute
        return compute + num_ar * allreduce_time(tokens * self.model.hidden_size * self.act_bytes, self.tp, self.link)

    def swap_time(self, num_tokens: int) -> float:
        return self.cost.swap_time(num_tokens) * _kv_fraction(self.model, self.tp)   # each rank over its own PCIe

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int | None:
        """KV tokens that fit beside each rank's 1/tp of the weights; None when the hardware has no memory figure."""
        hw, m = self.cost.hardware, self.model
        if not hw.mem_bytes:
            return None
        free = hw.mem_bytes * gpu_memory_utilization - m.weight_bytes(self.cost.dtype_bytes) / self.tp
        tokens = math.floor(free / (self.kv_bytes_per_token * _kv_fraction(m, self.tp)))
        if tokens <= 0:
            raise ValueError(f"{m.name}'s weights split {self.tp} ways do not fit {gpu_memory_utilization:.0%} of a "
                             f"{hw.name}: use a larger tp")
        return tokens


# ---- the lecture's advice as a table ----------------------------------------------------------------------------
def _default_layouts(topology: Topology) -> list[tuple[str, Layout]]:
    n, g, nodes = topology.num_gpus, topology.gpus_per_node, topology.num_nodes
    out = [("TP only", Layout(tp=n)), ("PP only", Layout(pp=n))]
    if nodes > 1:
        out += [("TP in node x PP across nodes", Layout(tp=g, pp=nodes)),
                ("DP replicas (one per node)", Layout(tp=g, dp=nodes))]
    return out


def plan(shape: ModelShape = LLAMA3_70B, hardware: Accelerator | str = "H100-SXM",
         topology: Topology | None = None, batch: int = 64, context_len: int = 2048, dtype_bytes: float = 2,
         in_flight: int | None = None, gpu_memory_utilization: float = 0.9,
         layouts: Sequence[tuple[str, Layout]] | None = None) -> list[dict]:
    """Compare ways to serve `shape` on `topology` (default: 2 nodes x 8 GPUs, NVLink4 inside, IB-NDR between):
    TP over every GPU, PP over every GPU, TP in a node x PP across nodes, one replica per node. One decode step of
    `batch` sequences at `context_len` (`decode_step`) per row: per-token latency (TPOT), throughput, where the
    time goes, the links used, and whether weights + KV fit in `gpu_memory_utilization` of each GPU. Default
    layouts the model's heads or layers do not allow are left out; `layouts` you pass raise ValueError instead."""
    acc = get_accelerator(hardware) if isinstance(hardware, str) else hardware
    topology = topology or Topology.of(8, 2)
    cost = StepCost(acc, shape, dtype_bytes)
    rows = []
    for name, layout in layouts or _default_layouts(topology):
        try:
            layout.check(shape, topology)
        except ValueError:
            if layouts:
                raise
            continue
        step = decode_step(cost, topology, layout, batch, context_len, in_flight)
        share = math.ceil(shape.num_layers / layout.pp) / shape.num_layers
        kv = math.ceil(batch / layout.dp) * shape.kv_cache_bytes(context_len, 1, dtype_bytes) * _kv_fraction(shape, layout.tp)
        mem = share * (shape.weight_bytes(dtype_bytes) / layout.tp + kv)
        rows.append({"plan": name, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "gpus": layout.num_gpus,
                     "tp_link": step.tp_link, "pp_link": step.pp_link, "tpot_ms": step.time_s * 1e3,
                     "tokens_per_s": step.tokens_per_s, "compute_ms": step.compute_s * 1e3,
                     "tp_comm_ms": step.tp_comm_s * 1e3, "send_ms": step.send_s * 1e3, "bubble": step.bubble,
                     "gpu_mem_GB": mem / 1e9, "fits": mem <= acc.mem_bytes * gpu_memory_utilization})
    return rows


def tp_link_table(shape: ModelShape = LLAMA3_70B, hardware: Accelerator | str = "H100-SXM",
                  links: Sequence[Link | str] | None = None, tps: Sequence[int] = (2, 4, 8), batch: int = 1,
                  context_len: int = 1024, dtype_bytes: float = 2) -> list[dict]:
    """Decision-chart data: decode TPOT of `shape` at each TP size if its GPUs were connected by each link (every
    link in `hardware.LINKS` by default, each with its own bandwidth and latency). One row per (link, tp):
    compute and all-reduce time per token and whether the shard fits one GPU. At batch 1 the all-reduces are
    latency-bound (the lecture: TP is more sensitive to latency than to bandwidth); raise `batch` to see
    bandwidth matter."""
    acc = get_accelerator(hardware) if isinstance(hardware, str) else hardware
    cost = StepCost(acc, shape, dtype_bytes)
    rows = []
    for link in links or list(LINKS.values()):
        link = get_link(link) if isinstance(link, str) else link
        for tp in tps:
            step = decode_step(cost, Topology(tp, 1, link, link), Layout(tp=tp), batch, context_len)
            rows.append({"link": link.name, "bandwidth_GBps": link.bandwidth / 1e9, "latency_us": link.latency * 1e6,
                         "tp": tp, "tpot_ms": step.time_s * 1e3, "compute_ms": step.compute_s * 1e3,
                         "comm_ms": step.tp_comm_s * 1e3,
                         "fits": shape.weight_bytes(dtype_bytes) / tp <= acc.mem_bytes})
    return rows


def plot_tp_link_chart(rows: Sequence[dict], title: str = ""):
    """Per-token time vs link (fastest first), one line per TP size, from `tp_link_table` rows. Returns a Figure."""
    from matplotlib.ticker import FuncFormatter

    from llmso_lab.viz import LabFigure

    fig = LabFigure(figsize=(7, 4))
    ax = fig.add_subplot()
    names = list(dict.fromkeys(r["link"] for r in rows))
    for tp in sorted({r["tp"] for r in rows}):
        by_link = {r["link"]: r for r in rows if r["tp"] == tp}
        xs = [i for i, n in enumerate(names) if n in by_link]
        ax.plot(xs, [by_link[names[i]]["tpot_ms"] for i in xs], "o-", label=f"TP={tp}")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([f"{n}\n{next(r['bandwidth_GBps'] for r in rows if r['link'] == n):g} GB/s" for n in names],
                       fontsize=8)
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_ylabel("time per decode token (ms)")
    ax.set_title(title or "Tensor parallelism: per-token time by link")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---- measuring a link: fit latency and bandwidth ----------------------------------------------------------------
def fit_link(points: Sequence[tuple[float, float]], name: str = "fitted") -> Link:
    """Fit `t = latency + nbytes / bandwidth` to (nbytes, seconds) points by least squares on RELATIVE errors
    (each point weighted 1 / t, so a 4-byte and a 16 MB message count alike). A negative intercept (noise) is
    clamped to latency 0 and the slope refitted through the origin. ValueError if the times do not grow with size."""
    pts = [(float(b), float(t)) for b, t in points]
    if len(pts) < 2 or len({b for b, _ in pts}) < 2:
        raise ValueError("fit_link needs at least two points with different sizes")
    if any(b < 0 or not t > 0 or not math.isfinite(t) for b, t in pts):
        raise ValueError("every point needs nbytes >= 0 and a finite time > 0")
    w = [1 / t**2 for _, t in pts]               # minimise sum ((a + b x - t) / t)^2
    sw, sx, st = sum(w), sum(wi * b for wi, (b, _) in zip(w, pts)), sum(wi * t for wi, (_, t) in zip(w, pts))
    sxx = sum(wi * b * b for wi, (b, _) in zip(w, pts))
    sxt = sum(wi * b * t for wi, (b, t) in zip(w, pts))
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    latency = (st - slope * sx) / sw
    if latency < 0:
        latency, slope = 0.0, sxt / sxx
    if not slope > 0:
        raise ValueError("the times do not grow with the message size: measure larger sizes")
    return Link(name, 1 / slope, latency)


def link_from_allreduce(points: Sequence[tuple[float, float]], n: int, name: str = "fitted") -> Link:
    """The Link whose `allreduce_time(nbytes, n, link)` best matches measured (nbytes, seconds) all-reduce points:
    t / (2 (n - 1)) = latency + (nbytes / n) / bandwidth, fitted with `fit_link`."""
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"an all-reduce needs n >= 2 ranks, got {n!r}")
    return fit_link([(b / n, t / (2 * (n - 1))) for b, t in points], name)


def _time_allreduce(rank: int, world_size: int, sizes: Sequence[int], budget_s: float) -> list[tuple[int, float]]:
    """In each rank: the fastest of repeated all_reduce calls on a float32 tensor of each size (bytes). Rank 0
    picks the repeat count from a warm-up call and broadcasts it: every rank must make the same calls."""
    import torch
    import torch.distributed as dist

    out = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4))
        t0 = time.perf_counter()
        dist.all_reduce(x)                       # warm-up: connections, buffers
        runs = torch.tensor([min(200, max(3, int(budget_s / max(time.perf_counter() - t0, 1e-6))))])
        dist.broadcast(runs, src=0)
        best = math.inf
        for _ in range(int(runs)):
            dist.barrier()                       # start together: time the all-reduce, not a late peer
            t0 = time.perf_counter()
            dist.all_reduce(x)
            best = min(best, time.perf_counter() - t0)
        out.append((x.numel() * 4, best))
    return out


def measure_gloo_allreduce(world_size: int = 2, sizes: Sequence[int] = (4, 1 << 16, 1 << 20, 1 << 22),
                           budget_s: float = 0.2, timeout_s: float = 60.0) -> list[tuple[int, float]]:
    """(nbytes, seconds) of gloo all_reduce over loopback TCP on THIS machine, `world_size` processes started by
    the launcher, one thread each; each size timed for about `budget_s` (best run: others are interruptions).
    One launch: a few seconds of process start-up plus len(sizes) x budget_s."""
    from llmso_lab.parallel.launcher import launch

    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an int >= 2 to measure a link, got {world_size!r}")
    if not sizes or any(not isinstance(s, int) or s < 4 for s in sizes):
        raise ValueError(f"sizes must be ints >= 4 bytes (one float32), got {sizes!r}")
    return launch(_time_allreduce, world_size, args=(tuple(sizes), budget_s), timeout_s=timeout_s,
                  threads_per_rank=1)[0]


def measure_gloo_link(world_size: int = 2, sizes: Sequence[int] = (4, 1 << 16, 1 << 20, 1 << 22),
                      budget_s: float = 0.2) -> Link:
    """This machine's loopback "link" as the labs' multi-process code sees it: `measure_gloo_allreduce` fitted
    with `link_from_allreduce` (latency from the tiny tensor, bandwidth from the large ones). Under 10 s."""
    points = measure_gloo_allreduce(world_size, sizes, budget_s)
    return link_from_allreduce(points, world_size, f"gloo loopback ({world_size} ranks)")
