"""Serving simulator: a roofline cost model of one engine step, a discrete-event engine on top, and a cluster of
replicas with prefix caches behind a router (`cluster`)."""
from llmso_lab.sim.budget import plan_token_budget, prefill_chunk
from llmso_lab.sim.cluster import ClusterConfig, ClusterResult, simulate_cluster
from llmso_lab.sim.calibrate import calibrate, cpu_profile, relative_errors
from llmso_lab.sim.calibrate import EngineRun, EngineStepRecord, records_from_engine_traces, run_on_engine
from llmso_lab.sim.calibrate import StepDecisions, decisions_from_engine_traces, decisions_from_sim
from llmso_lab.sim.cost import CostModel, StepBreakdown, StepCost, UnitCost
from llmso_lab.sim.grid import (continuous_slot_grid, lecture_requests, lecture_slot_grids, slot_utilization,
                                static_slot_grid, trace_slot_grid)
from llmso_lab.policies import pick_victim, policy_key
from llmso_lab.sim.preemption import PreemptionCosts, preemption_costs
from llmso_lab.sim.results import RequestMetrics, SimResult, SimStep
from llmso_lab.sim.simulator import SimConfig, simulate

__all__ = [
    "CostModel", "StepCost", "StepBreakdown", "UnitCost", "cpu_profile", "calibrate", "relative_errors",
    "SimConfig", "simulate", "SimResult", "SimStep", "RequestMetrics", "policy_key", "pick_victim",
    "lecture_requests", "lecture_slot_grids", "static_slot_grid", "continuous_slot_grid", "slot_utilization", "trace_slot_grid", "PreemptionCosts", "preemption_costs",
    "plan_token_budget", "prefill_chunk", "EngineStepRecord", "records_from_engine_traces", "EngineRun", "run_on_engine",
    "StepDecisions", "decisions_from_engine_traces", "decisions_from_sim",
    "ClusterConfig", "ClusterResult", "simulate_cluster",
]
