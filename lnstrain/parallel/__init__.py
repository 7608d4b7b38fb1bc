"""Parallelism: process groups, tensor-parallel layers and their communication, DeepSpeed's comm layer.

Nothing here knows the model: ``lnstrain.model.build`` puts the model together from these pieces.
"""

from lnstrain.parallel.groups import ParallelGroups, RankLayout, layout_problems

__all__ = ["ParallelGroups", "RankLayout", "layout_problems"]
