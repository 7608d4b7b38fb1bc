#!/usr/bin/env python
"""Plan, launch and summarise a scaling study (sizes × variants × norm schemes × seeds).

    python launch/scaling_study.py plan    configs/studies/lns_scaling.yaml   # runs, layouts, memory, GPU-hours
    python launch/scaling_study.py run     configs/studies/lns_scaling.yaml   # launch unfinished runs (resumes)
    python launch/scaling_study.py collect configs/studies/lns_scaling.yaml   # results.csv, results.md, scaling.png

With a ``depth`` section in the study, ``collect`` also analyses the runs' checkpoints with the depth
analysis and checks the LNS paper's claims at every training length (docs/depth_analysis.md).

``plan`` exits 1 when a run fits no layout; ``run`` launches nothing then (``--skip-refused``
launches the others) and exits 1 if any run failed. Plans and results go to
``<output_dir>/_study/``. See docs/scaling_study.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lnstrain.config.loader import ConfigError  # noqa: E402
from lnstrain.study.collect import collect_results  # noqa: E402
from lnstrain.study.launchers import launch_study, run_status  # noqa: E402
from lnstrain.study.plan import format_plan, measured_speed, plan_rows, plan_study  # noqa: E402
from lnstrain.study.spec import load_study  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("command", choices=["plan", "run", "collect"])
    parser.add_argument("study", help="study YAML, e.g. configs/studies/lns_scaling.yaml")
    parser.add_argument("--skip-refused", action="store_true", help="run: launch the runs that fit, skip the rest")
    parser.add_argument("--no-launch", action="store_true",
                        help="run: write each unfinished run's directory and study_config.yaml, launch nothing "
                             "(to start runs your own way, e.g. several at once)")
    parser.add_argument("--mfu-from", metavar="BENCH_JSON",
                        help="plan: GPU-hours at the MFU a `tools/benchmark.py --json` file measured, instead of the "
                             "study's assumed cluster.mfu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        study = load_study(args.study)
        speed = measured_speed(args.mfu_from) if args.mfu_from else None
        planned = plan_study(study, speed)
    except ConfigError as error:
        print(f"lnstrain: {error}", file=sys.stderr)
        return 2
    report_dir = study.output_dir / "_study"
    report_dir.mkdir(parents=True, exist_ok=True)
    refused = [p for p in planned if p.error]

    if args.command == "plan":
        text = format_plan(study, planned, speed)
        (report_dir / "plan.md").write_text(text + "\n", encoding="utf-8")
        (report_dir / "plan.json").write_text(json.dumps(plan_rows(planned), indent=2) + "\n", encoding="utf-8")
        text += f"\n\nStatus of each run in {study.output_dir}:"
        for p in planned:
            text += f"\n- {p.run.name}: {run_status(p.config.run.dir, p.config.checkpoint_dir, p.config.total_steps)}"
        print(text)
        return 1 if refused else 0

    if args.command == "run":
        if refused and not args.skip_refused:
            print("refusing to launch: " + "; ".join(f"{p.run.name}: {p.error}" for p in refused)
                  + "\n(rerun with --skip-refused to launch the others)", file=sys.stderr)
            return 1
        results = launch_study(study, [p for p in planned if not p.error], launch=not args.no_launch)
        for result in results:
            print(f"{result.run:<32} {result.status:<10} {result.detail}")
        return 1 if any(r.status == "failed" for r in results) else 0

    rows, files = collect_results(planned, report_dir, study.spec.sizes, study.spec.schemes,
                                  f"Study '{study.spec.name}': final validation loss")
    print(files["markdown"].read_text(encoding="utf-8"))
    if study.spec.depth is not None:
        from lnstrain.study.depth import collect_depth

        depth_files = collect_depth(study, [p for p in planned if not p.error])
        print(depth_files["depth report"].read_text(encoding="utf-8"))
        files.update(depth_files)
    print("\n".join(f"wrote {path}" for path in files.values()))
    if "plot" not in files:
        print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    missing = [r["run"] for r in rows if r["status"] != "done"]
    if missing:
        print(f"{len(missing)} run(s) without final metrics: {', '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
