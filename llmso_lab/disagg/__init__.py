"""Prefill-decode disaggregation (lecture 2-3): separate prefill and decode engines, KV shipped between them."""
from llmso_lab.disagg.llm import DisaggregatedLLM, RequestFailedError
from llmso_lab.disagg.router import LOCAL, pd_route
from llmso_lab.disagg.transfer import exposed_transfer_time, kv_transfer_bytes, transfer_timeline

__all__ = ["DisaggregatedLLM", "RequestFailedError", "LOCAL", "pd_route", "exposed_transfer_time", "kv_transfer_bytes",
           "transfer_timeline"]
