"""Estimates made before a run exists: parameters, FLOPs, token budget, memory per rank."""

from lnstrain.estimate.flops import FlopsPerToken, flops_per_token
from lnstrain.estimate.memory import MemoryEstimate, memory_estimate
from lnstrain.estimate.report import dry_run_report, dry_run_summary

__all__ = ["FlopsPerToken", "MemoryEstimate", "dry_run_report", "dry_run_summary", "flops_per_token",
           "memory_estimate"]
