"""Parallelism: process groups, tensor-parallel layers and communication, pipeline stages."""

from lnstrain.parallel.groups import ParallelGroups, RankLayout, layout_problems

__all__ = ["ParallelGroups", "RankLayout", "layout_problems"]
