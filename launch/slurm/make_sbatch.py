#!/usr/bin/env python
"""Write the SLURM batch script that trains one config on whole nodes of a cluster profile.

    python launch/slurm/make_sbatch.py --config configs/7b_lns.yaml --gpus 16 \\
        --cluster configs/clusters/a100_80g_slurm.yaml > 7b_lns.sbatch && sbatch 7b_lns.sbatch
    python launch/slurm/make_sbatch.py --config configs/7b_lns.yaml --gpus 16 \\
        --cluster configs/clusters/a100_80g_slurm.yaml --submit     # <run dir>/job.sbatch, submitted

The job outlives its time limit: it saves, requeues itself and resumes until the run is finished
(``slurm.requeue``, ``slurm.max_requeues``), or, where requeueing is forbidden, ``--submit`` queues a
chain of ``slurm.chain_jobs`` jobs. Studies write these scripts themselves (``launch/scaling_study.py
run`` with ``launcher: slurm``). See docs/cluster.md.
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
from lnstrain.no_follow import write_text_replacing  # noqa: E402
from lnstrain.run_files import JOB_SCRIPT, SLURM_OUTPUT  # noqa: E402
from lnstrain.study.slurm import render_sbatch, submit  # noqa: E402
from lnstrain.study.spec import ClusterProfile  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all (whole nodes)")
    parser.add_argument("--cluster", required=True, help="cluster profile YAML (configs/clusters/)")
    parser.add_argument("--mode", choices=["per_node", "per_rank", "ssh"], help="override slurm.mode")
    parser.add_argument("--submit", action="store_true",
                        help="write the script to <run dir>/job.sbatch and submit it (slurm.chain_jobs jobs), "
                             "instead of printing it")
    args = parser.parse_args()
    cluster, problems = from_dict(ClusterProfile, yaml.safe_load(Path(args.cluster).read_text()) or {})
    if args.mode and not problems:
        cluster.slurm.mode = args.mode
    problems = problems or cluster.slurm.validate()
    if problems:
        parser.error(f"{args.cluster}: " + "; ".join(problems))
    config = load_config(args.config, validate=False)
    run_dir = config.run.dir.resolve()
    script = render_sbatch(config.run.name, run_dir, str(Path(args.config).resolve()), args.gpus, cluster, REPO,
                           config.checkpoint_dir.resolve())
    if not args.submit:
        sys.stdout.write(script)
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens --output there before the script runs
    path = run_dir / JOB_SCRIPT
    write_text_replacing(path, script)  # a new file: a link planted there is replaced, not written through
    try:
        job_ids = submit(path, cluster.slurm.chain_jobs)
    except (RuntimeError, FileNotFoundError) as error:
        print(f"make_sbatch: {error}", file=sys.stderr)
        return 1
    chain = f" (a chain of {len(job_ids)}, each after the one before)" if len(job_ids) > 1 else ""
    print(f"submitted {path}: job{'s' * (len(job_ids) > 1)} {' '.join(job_ids)}{chain}; "
          f"output in {run_dir / SLURM_OUTPUT.replace('%j', '<job id>')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
