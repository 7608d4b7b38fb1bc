"""The multi-rank helpers tests use (``run_distributed``, ``free_port``, ``distributed_env``), which live
in ``lnstrain.parallel.local_ranks`` since production code (the launcher, the benchmarks) needs them
too and never imports ``lnstrain.testing``."""

from lnstrain.parallel.local_ranks import RankFunction, distributed_env, free_port, run_distributed

__all__ = ["RankFunction", "distributed_env", "free_port", "run_distributed"]
