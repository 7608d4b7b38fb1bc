#!/usr/bin/env python
"""Inside a SLURM job: print the DeepSpeed hostfile of the job's nodes, or (--master) the first node.

    python launch/slurm/hostfile.py --slots 8 > hostfile     # 'node01 slots=8' per node
    python launch/slurm/hostfile.py --master                 # rendezvous host
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lnstrain.study.slurm import expand_nodelist, hostfile_text  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--slots", type=int, default=8, help="GPUs per node")
    parser.add_argument("--master", action="store_true", help="print only the first node's name")
    parser.add_argument("--nodelist", default=os.environ.get("SLURM_JOB_NODELIST", ""),
                        help="compressed node list (default: $SLURM_JOB_NODELIST)")
    args = parser.parse_args()
    if not args.nodelist:
        parser.error("no node list: run inside a SLURM job or pass --nodelist 'node[01-04]'")
    hosts = expand_nodelist(args.nodelist)
    sys.stdout.write(hosts[0] + "\n" if args.master else hostfile_text(hosts, args.slots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
