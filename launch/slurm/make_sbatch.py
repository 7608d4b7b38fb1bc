#!/usr/bin/env python
"""Write the SLURM batch script that trains one config on whole nodes of a cluster profile.

    python launch/slurm/make_sbatch.py --config configs/7b_lns.yaml --gpus 16 \\
        --cluster configs/clusters/a100_80g_slurm.yaml > 7b_lns.sbatch && sbatch 7b_lns.sbatch

Studies write these themselves (``launch/scaling_study.py run`` with ``launcher: slurm``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lnstrain.config.loader import from_dict  # noqa: E402
from lnstrain.config.run_config import load_config  # noqa: E402
from lnstrain.study.slurm import render_sbatch  # noqa: E402
from lnstrain.study.spec import ClusterProfile  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all (whole nodes)")
    parser.add_argument("--cluster", required=True, help="cluster profile YAML (configs/clusters/)")
    parser.add_argument("--mode", choices=["per_node", "per_rank", "ssh"], help="override slurm.mode")
    args = parser.parse_args()
    cluster, problems = from_dict(ClusterProfile, yaml.safe_load(Path(args.cluster).read_text()) or {})
    if problems:
        parser.error("; ".join(problems))
    if args.mode:
        cluster.slurm.mode = args.mode
    config = load_config(args.config, validate=False)
    sys.stdout.write(render_sbatch(config.run.name, config.run.dir.resolve(), str(Path(args.config).resolve()),
                                   args.gpus, cluster, REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
