"""Estimates made before a run exists: parameters per rank (``parameters``), FLOPs (``flops``), memory
per rank (``memory``) and the dry-run report that combines them (``report``). Import the module you
need: this package imports none of them, so the DeepSpeed JSON can use ``parameters`` while
``report`` uses the DeepSpeed JSON."""
