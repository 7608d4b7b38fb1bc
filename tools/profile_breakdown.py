#!/usr/bin/env python
"""Where a profiled step's time went, read again from a stored report: busy time and categories as shares
of the step, without the double count of annotations (``lnstrain.benchmark.profile.breakdown``).

    python tools/profile_breakdown.py docs/gpu_check/h100_2026-11-26_call1/gpu_check.json
    python tools/profile_breakdown.py bench.json          # a tools/benchmark.py --json report

Prints one block per profiled report (every item of a gpu_check.json that has one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lnstrain.benchmark.profile import breakdown  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402


def profiled_reports(doc: dict) -> dict[str, dict]:
    """name -> benchmark report with a profile, from a gpu_check.json or a single benchmark report."""
    if "items" in doc:
        return {name: item["report"] for name, item in doc["items"].items()
                if (item.get("report") or {}).get("profile")}
    return {"report": doc} if doc.get("profile") else {}


def describe(name: str, report: dict) -> list[str]:
    step_s = report["runners"][0]["step_time_s"]["median"]
    result = breakdown(report["profile"], step_s)
    lines = [f"{name}: step {result['step_ms']:.1f} ms (median of {report['runners'][0]['name']}); device busy "
             f"{result['busy_ms_per_step']:.1f} ms = {result['busy_percent_of_step']:.1f}% of the step"
             + (f" ({-result['annotation_ms_left_out']:.1f} ms of annotations left out)"
                if result["annotation_ms_left_out"] else "")]
    for category, ms in sorted(result["categories_ms_per_step"].items(), key=lambda item: -item[1]):
        lines.append(f"  {category:<18} {ms:8.1f} ms  {result['categories_percent_of_step'][category]:5.1f}% of the step")
    if result["unlisted_ms"]:
        lines.append(f"  {'(not in the rows)':<18} {result['unlisted_ms']:8.1f} ms  "
                     f"{100 * result['unlisted_ms'] / result['step_ms']:5.1f}% of the step")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("reports", nargs="+", help="gpu_check.json or tools/benchmark.py --json files")
    args = parser.parse_args(argv)
    for path in args.reports:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            print(f"profile_breakdown: cannot read {path}: {error}", file=sys.stderr)
            return 2
        reports = profiled_reports(doc)
        if not reports:
            print(f"{path}: no profiled report")
        for name, report in reports.items():
            print("\n".join(describe(f"{path} {name}", report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
