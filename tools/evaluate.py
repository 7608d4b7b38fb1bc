#!/usr/bin/env python
"""Downstream evaluation: EleutherAI lm-evaluation-harness tasks on an lnstrain checkpoint or a Hugging Face model.

    # a checkpoint of any parallel layout (run, checkpoint or global_step<N> directory), through the
    # Hugging Face export in memory; results go to <run dir>/downstream/step<N>.json and to the run's
    # TensorBoard and W&B at the checkpoint's step
    python tools/evaluate.py --checkpoint runs/lns --tasks hellaswag,arc_easy,piqa
    # a Hugging Face model directory
    python tools/evaluate.py --hf hf/lns --tasks arc_easy --output results/lns_arc.json
    # a local task (its YAML under an include path; needs no network)
    python tools/evaluate.py --checkpoint runs/tiny --tasks lnstrain_tiny_grammar --include-path configs/eval_tasks

Task names are lm-eval's own (``python -m lm_eval ls tasks`` lists them). Built-in tasks download
their data sets through the datasets library on first use; with HF_DATASETS_OFFLINE=1, or where the
Hugging Face Hub does not answer within 3 s, only the cache is read. Every task's data is loaded
before the model, so a data set that cannot be had ends the command at once. The console shows the
results and lnstrain's lines; --verbose adds lm-eval's, transformers' and the progress bars.
Exit status 0, or 2 for a problem with the command line, the model, its tokenizer or the tasks' data.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.checkpoint.verifier import add_trust_arguments, trust_from_arguments  # noqa: E402
from lnstrain.evaluation.downstream import (DownstreamTasks, evaluate_downstream, log_to_run,  # noqa: E402
                                            stay_offline_unless_the_hub_answers, task_data_problems, task_problems)
from lnstrain.evaluation.results import write_results  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402
from lnstrain.run_files import downstream_file  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="an lnstrain run directory, its checkpoints/ (newest complete step) or "
                                             "one global_step<N>, of any parallel layout")
    source.add_argument("--hf", metavar="DIR", help="a local Hugging Face causal language model directory")
    p.add_argument("--tasks", required=True,
                   help="comma-separated lm-eval task, group or tag names (e.g. hellaswag,arc_easy), or task YAML paths")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help="a directory of task YAMLs of your own (repeatable), as lm-eval's --include_path")
    p.add_argument("--num-fewshot", type=int, help="examples per prompt (default: each task's own, 0 for most)")
    p.add_argument("--limit", type=float, help="at most this many documents per task (below 1: that share); for "
                                               "quick looks, not for figures")
    p.add_argument("--batch-size", default="8", help="requests per forward pass, or 'auto' on a GPU (default: 8)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="weights and computation: auto is fp32 for a checkpoint (its exact logits) and the stored "
                        "dtype for a Hugging Face directory")
    p.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda (default: cpu)")
    p.add_argument("--output", help="results JSON (default for a checkpoint: <run dir>/downstream/step<N>.json; "
                                    "required with --hf)")
    p.add_argument("--no-log", action="store_true",
                   help="write the JSON only, not the checkpoint's run's TensorBoard and W&B")
    p.add_argument("--verbose", action="store_true",
                   help="also lm-eval's, transformers' and datasets' messages and progress bars (default: the "
                        "results, lnstrain's lines and every error)")
    add_trust_arguments(p)  # a checkpoint is verified first, as a resume would (docs/checkpoints.md)
    return p.parse_args(argv)


def configure_output(verbose: bool) -> None:
    """lnstrain's lines and every library's errors; the libraries' notes and progress bars only when
    ``verbose`` (lm-eval warns that it was handed a model object, which is how lnstrain calls it)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, force=True,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lnstrain").setLevel(logging.INFO)
    if verbose:
        return
    for quiet in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS",
                  "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        os.environ.setdefault(quiet, "1")
    for noisy in ("lm_eval", "lm-eval", "transformers", "datasets", "huggingface_hub", "accelerate", "DeepSpeed",
                  "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def nothing_evaluated(problems: list[str]) -> int:
    """The problems on stderr (one on one line), exit status 2."""
    listed = problems[0] if len(problems) == 1 else "\n  " + "\n  ".join(problems)
    print(f"evaluate: nothing was evaluated: {listed}", file=sys.stderr)
    return 2


def _batch_size(text: str) -> int | str:
    return text if text.startswith("auto") else int(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_output(args.verbose)
    offline = stay_offline_unless_the_hub_answers()  # before the Hugging Face libraries are imported
    from lnstrain.parallel.deepspeed_comm import name_cpu_accelerator_if_no_cuda

    name_cpu_accelerator_if_no_cuda()  # a checkpoint's files import DeepSpeed, which warns without it
    try:
        tasks = DownstreamTasks([name.strip() for name in args.tasks.split(",") if name.strip()],
                                list(args.include_path), args.num_fewshot, args.limit, _batch_size(args.batch_size))
    except ValueError:
        print(f"evaluate: --batch-size must be a whole number or 'auto' (got {args.batch_size!r})", file=sys.stderr)
        return 2
    problems = task_problems(tasks)
    if args.hf and not args.output:
        problems.append("--output: name the results JSON for a Hugging Face model (--output results.json)")
    if problems:
        return nothing_evaluated(problems)
    from lnstrain.evaluation.hf_model import hf_directory_tokenizer, load_checkpoint_model, load_hf_directory_model

    try:
        tokenizer = hf_directory_tokenizer(args.hf) if args.hf else None
    except ValueError as e:
        print(f"evaluate: nothing was evaluated: {e}", file=sys.stderr)
        return 2
    problems = task_data_problems(tasks, offline)
    if problems:
        return nothing_evaluated(problems)
    try:
        if args.checkpoint:
            model = load_checkpoint_model(args.checkpoint, "fp32" if args.dtype == "auto" else args.dtype,
                                          args.device, trust_from_arguments(args, args.checkpoint))
        else:
            model = load_hf_directory_model(args.hf, args.dtype, args.device, tokenizer)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 2
    output = args.output or (downstream_file(model.run_dir, model.step) if model.run_dir is not None else None)
    if output is None:
        print(f"evaluate: cannot find the run directory of {args.checkpoint}; name the results JSON with --output",
              file=sys.stderr)
        return 2
    results = evaluate_downstream(model, tasks, quiet=not args.verbose)
    path = write_results(results, output)
    for task, values in results["metrics"].items():
        print(f"{task}: " + ", ".join(f"{metric} {value:.4f}" for metric, value in values.items() if value is not None))
    print(f"results: {path}")
    if not args.no_log and model.run_dir is not None:
        logged = log_to_run(results, model, wandb=_run_not_training(model.run_dir))
        if logged:
            print(f"logged at step {model.step} to the run's {' and '.join(logged)} ({model.run_dir})")
    return 0


def _run_not_training(run_dir: Path) -> bool:
    """W&B takes one writer per run: while a trainer holds the run directory, only TensorBoard is written."""
    from lnstrain.training.run_lock import probe

    message = probe(run_dir)
    if message:
        logging.getLogger("evaluate").warning("not logging to W&B: %s; the trainer's own train.eval_tasks log there", message)
    return message is None


if __name__ == "__main__":
    sys.exit(main())
