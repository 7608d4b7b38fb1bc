#!/usr/bin/env python
"""What lnstrain's checkpoint checks cost: a save with them against DeepSpeed's plain save, and a
resume's verification of every file, each also as a fraction of DeepSpeed's plain save; with
--background, what a save costs the training loop, synchronous against written in the background
(``checkpoint.async_save``), in one run.

    python tools/benchmark_checkpoint.py --config configs/130m_lns.yaml --dir /tmp/checkpoint_bench
    python tools/benchmark_checkpoint.py --config configs/130m_lns.yaml --set precision.dtype=fp32 --dir /tmp/b
    python tools/benchmark_checkpoint.py --config configs/130m_lns.yaml --set precision.dtype=fp32 \
        --dir /tmp/checkpoint_bench --background --repeats 3

One rank builds the config's model and DeepSpeed engine, takes one optimizer step on random tokens
(so the Adam moments exist), then alternates --repeats times: DeepSpeed's own save_checkpoint plus
an fsync (what a save costs without lnstrain's checks), and lnstrain's CheckpointManager.save (the
finiteness check, SHA-256 of every file as it is written, the RNG/metadata files, fsync, the
completion marker, signed with a throw-away key). It also times the finiteness check alone, SHA-256
of the saved files alone, the pre-launch check's quick verification (marker, listing, sizes,
metadata) and the resume's full verification (size and SHA-256 of each file, the pickle scan) twice:
right after the save (page cache warm) and after asking the kernel to drop the files' cached pages
(posix_fadvise DONTNEED: a cold read, as after a restart on another node). Then what issue 41's
checks cost: a forged marker that lists a 50 GiB sparse file, verified with the key (the signature
is checked before anything it lists is read) and without (the sizes listed are compared before any
file is hashed), and the pickle scan of every .pt file, in torch's zip format as saved and re-saved in
its legacy format (each of the five pickles walked opcode by opcode). Prints the medians of
wall-clock and process CPU time (all threads; the steadier of the two on a shared machine), and
each as a fraction of DeepSpeed's save. Files are deleted after each save.

With --background each repeat takes --steps plain steps (the normal step time), a synchronous save
(the time it blocks is all of it), then a save in the background (the time it blocks: the finiteness
check, DeepSpeed's save_checkpoint with the host snapshot, the RNG states) followed by steps until
its files are published at a step boundary (the step time while the write runs). It prints medians
and the two ratios, blocking time background / synchronous and step time during the write / normal,
both from the same run, and (Linux) the CPU time of the training's own threads per step, normal and
during the write (every thread but the writer's: steadier than wall-clock time on a shared machine,
and it still shows what the write costs the training through memory bandwidth and caches).
--torch-dcp adds torch.distributed.checkpoint.async_save of the engine's model and optimizer state
dicts (another file format; for comparison only).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lnstrain.config.loader import add_override_argument  # noqa: E402
from lnstrain.help_formatter import HelpFormatter  # noqa: E402

SHORT_STEP = ["train.global_batch_size=1", "train.micro_batch_size=1", "data.seq_len=32"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--config", required=True, help="run description (YAML); its data files are not needed")
    add_override_argument(parser)
    parser.add_argument("--dir", required=True, help="where to write the checkpoints (emptied of them afterwards)")
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind")
    parser.add_argument("--background", action="store_true",
                        help="time saves in the background against synchronous ones, with training steps between")
    parser.add_argument("--steps", type=int, default=3, help="with --background: plain steps timed per repeat")
    parser.add_argument("--writer-niceness", type=int, default=None,
                        help="with --background: the background writer's nice value (default: lnstrain's, "
                             "lnstrain.checkpoint.async_save.WRITER_NICENESS)")
    parser.add_argument("--torch-dcp", action="store_true",
                        help="with --background: also time torch.distributed.checkpoint.async_save")
    return parser.parse_args(argv)


def drop_cached_pages(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def threads_cpu_seconds(thread_ids: list[int]) -> float:
    """CPU seconds (user + system) these threads of this process have used (Linux; 0 elsewhere)."""
    ticks = 0
    for thread_id in thread_ids:
        try:
            fields = Path(f"/proc/self/task/{thread_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def timed(action) -> tuple[float, float]:
    """(wall-clock seconds, CPU seconds of this process, all threads) that ``action()`` took."""
    wall, cpu = time.perf_counter(), time.process_time()
    action()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lnstrain.parallel.local_ranks import single_rank_env

    os.environ.update(single_rank_env())
    from lnstrain.parallel.deepspeed_comm import init_deepspeed_comm, name_cpu_accelerator_if_no_cuda

    name_cpu_accelerator_if_no_cuda()
    init_deepspeed_comm("gloo")
    from lnstrain.benchmark.runners import synthetic_micro_batches
    from lnstrain.checkpoint.finite_state import nonfinite_state
    from lnstrain.checkpoint.integrity import file_record
    from lnstrain.checkpoint.manager import CheckpointManager, TrainingPosition
    from lnstrain.checkpoint.metadata import fsync_tree
    from lnstrain.checkpoint.safe_load import scan
    from lnstrain.checkpoint.signing import read_signing_key
    from lnstrain.checkpoint.verifier import QUICK, Trust, check_step_dir
    from lnstrain.config.run_config import load_config
    from lnstrain.parallel.groups import ParallelGroups
    from lnstrain.training.engine import build_engine

    directory = Path(args.dir)
    key_file = directory.parent / f".{directory.name}-benchmark.key"  # outside the checkpoint directory
    descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(descriptor, os.urandom(32).hex().encode())
    os.close(descriptor)
    overrides = list(args.overrides) + SHORT_STEP + [f"checkpoint.dir={directory}", "checkpoint.keep_last=null",
                                                     f"checkpoint.signing_key_file={key_file}"]
    config = load_config(args.config, overrides, 1, validate=False)
    engine = build_engine(config, ParallelGroups.build(1, 1))
    engine.train_step(synthetic_micro_batches(config, engine.accumulation_steps, seed=0))
    manager = CheckpointManager(config, (1, 1, 1), None, None)
    if args.background:
        try:
            return background_saves(args, config, engine, manager)  # signed, as the other saves
        finally:
            key_file.unlink()

    trust = Trust(key=read_signing_key(key_file))
    plain, checked, finite, hashing, quick, warm, cold, sizes = [], [], [], [], [], [], [], []
    forged, resized, zip_scan, legacy_scan = [], [], [], []
    for repeat in range(args.repeats):
        plain_dir = directory / f"plain{repeat}"

        def plain_save() -> None:
            engine.save_checkpoint(plain_dir)
            fsync_tree(plain_dir)

        plain.append(timed(plain_save))
        shutil.rmtree(plain_dir)
        checked.append(timed(lambda: manager.save(engine, TrainingPosition(step=repeat + 1))))
        step_dir = directory / f"global_step{repeat + 1}"
        finite.append(timed(lambda: nonfinite_state(engine)))
        files = [p for p in step_dir.rglob("*") if p.is_file()]
        hashing.append(timed(lambda: [file_record(p, 0) for p in files]))
        quick.append(timed(lambda: check_step_dir(step_dir, trust, depth=QUICK)))
        warm.append(timed(lambda: check_step_dir(step_dir, trust)))
        drop_cached_pages(step_dir)
        cold.append(timed(lambda: check_step_dir(step_dir, trust)))
        sizes.append(sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file()))
        forged_time, resized_time = forged_marker_checks(step_dir, trust)
        forged.append(forged_time)
        resized.append(resized_time)
        pickles = [p for p in files if p.suffix == ".pt"]
        zip_scan.append(timed(lambda: [scan(p) for p in pickles]))
        legacy = legacy_copies(pickles, directory / "legacy")
        legacy_scan.append(timed(lambda: [scan(p) for p in legacy]))
        shutil.rmtree(directory / "legacy")
        shutil.rmtree(step_dir)

    key_file.unlink()
    parameters = sum(p.numel() for p in engine.module.parameters())
    gib = statistics.median(sizes) / 2**30
    rows = [("DeepSpeed save + fsync", plain), ("lnstrain save (all checks)", checked),
            ("  finiteness check alone", finite), ("SHA-256 of the files alone", hashing),
            ("pre-launch check (quick)", quick), ("resume verification, warm", warm),
            ("resume verification, cold", cold), ("forged marker, 50 GiB, key", forged),
            ("forged marker, 50 GiB, no key", resized), ("pickle scan, zip format", zip_scan),
            ("pickle scan, legacy format", legacy_scan)]
    print(f"{args.config} {' '.join(args.overrides)}: {parameters / 1e6:.1f}M parameters, {config.precision.dtype}, "
          f"ZeRO-{config.parallel.zero_stage}, 1 rank; checkpoint {gib:.2f} GiB; medians of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"  {'':<31}{'wall s':>9}{'CPU s':>9}{'wall/DS save':>14}{'CPU/DS save':>13}")
    base_wall, base_cpu = (statistics.median(v[i] for v in plain) for i in (0, 1))
    for label, values in rows:
        wall, cpu = (statistics.median(v[i] for v in values) for i in (0, 1))
        rate = f"   {gib / wall:.2f} GiB/s" if label.startswith(("resume", "SHA")) else ""
        print(f"  {label:<31}{wall:9.3f}{cpu:9.3f}{wall / base_wall:14.3f}{cpu / base_cpu:13.3f}{rate}")
    return 0


def forged_marker_checks(step_dir: Path, trust) -> tuple[tuple[float, float], tuple[float, float]]:
    """(time of ``check_step_dir`` with ``trust``'s key, time without a key) of ``step_dir`` with a
    50 GiB sparse file planted and listed in its marker, as an attacker without the key would: the
    key's check must not read it; without the key its size, listed wrong, must not be hashed. The
    checkpoint is put back afterwards."""
    import json

    from lnstrain.checkpoint.metadata import COMPLETE_MARKER
    from lnstrain.checkpoint.verifier import Trust, check_step_dir

    marker, huge = step_dir / COMPLETE_MARKER, step_dir / "zero_pp_rank_9_mp_rank_00_optim_states.pt"
    saved = marker.read_bytes()
    content = json.loads(saved)
    with open(huge, "wb") as handle:
        handle.truncate(50 << 30)
    try:
        content["files"][huge.name] = {"size": 50 << 30, "sha256": "0" * 64, "rank": 0}
        marker.write_text(json.dumps(content))
        with_key = timed(lambda: check_step_dir(step_dir, trust))
        content["files"][huge.name]["size"] = 1 << 30
        marker.write_text(json.dumps(content))
        without_key = timed(lambda: check_step_dir(step_dir, Trust()))
    finally:
        huge.unlink()
        marker.write_bytes(saved)
    return with_key, without_key


def legacy_copies(pickles: list[Path], directory: Path) -> list[Path]:
    """``pickles`` re-saved in torch's legacy (non-zip) format under ``directory`` (read as the trainer reads
    them, ``weights_only`` with DeepSpeed's records)."""
    import torch

    from lnstrain.checkpoint.safe_load import load_deepspeed_file

    directory.mkdir(parents=True, exist_ok=True)
    copies = []
    for number, path in enumerate(pickles):
        copy = directory / f"{number}.pt"
        torch.save(load_deepspeed_file(path), copy, _use_new_zipfile_serialization=False)
        copies.append(copy)
    return copies


def background_saves(args: argparse.Namespace, config, engine, manager) -> int:
    """--background: the time saves block training, synchronous and in the background, and the step
    time while a background write runs."""
    import torch

    from lnstrain.benchmark.runners import synthetic_micro_batches
    from lnstrain.checkpoint import async_save
    from lnstrain.checkpoint.manager import TrainingPosition

    if args.writer_niceness is not None:
        async_save.WRITER_NICENESS = args.writer_niceness
    directory = Path(args.dir)
    seeds = iter(range(1, 10**9))
    training_threads: list[int] = []
    cpu: dict[str, list[float]] = {"normal": [], "during": [], "dcp": []}

    def step(phase: str = "normal") -> float:
        batch = synthetic_micro_batches(config, engine.accumulation_steps, seed=next(seeds))
        cpu_started, started = threads_cpu_seconds(training_threads), time.perf_counter()
        engine.train_step(batch)
        cpu[phase].append(threads_cpu_seconds(training_threads) - cpu_started)
        return time.perf_counter() - started

    step()  # warm-up beyond the first step: torch's and DeepSpeed's threads exist now, no writer's yet
    if os.path.isdir("/proc/self/task"):
        training_threads += [int(name) for name in os.listdir("/proc/self/task")]
    cpu["normal"].clear()

    normal, sync_block, async_block, snapshot, during, writes, steps_per_write = [], [], [], [], [], [], []
    dcp_block, dcp_during, dcp_total = [], [], []
    position = TrainingPosition()
    for _ in range(args.repeats):
        normal += [step() for _ in range(args.steps)]
        position.step += 1
        sync_block.append(timed(lambda: manager.save(engine, position))[0])
        shutil.rmtree(directory / f"global_step{position.step}")

        position.step += 1
        async_block.append(timed(lambda: manager.save(engine, position, in_background=True))[0])
        in_flight = manager.in_flight
        snapshot.append(in_flight.snapshot_seconds)
        count = 0
        while manager.publish_if_written() is None:
            during.append(step("during"))
            count += 1
        writes.append(in_flight.write_seconds)
        steps_per_write.append(count)
        shutil.rmtree(directory / f"global_step{position.step}")

        if args.torch_dcp:
            import torch.distributed.checkpoint as dcp

            target = directory / "torch_dcp"
            state = {"model": engine.module.state_dict(), "optimizer": engine.base_optimizer.state_dict()}
            started = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(target))
            dcp_block.append(time.perf_counter() - started)
            while not future.done():
                dcp_during.append(step("dcp"))
            future.result()
            dcp_total.append(time.perf_counter() - started)
            shutil.rmtree(target)

    parameters = sum(p.numel() for p in engine.module.parameters())
    print(f"{args.config} {' '.join(args.overrides)}: {parameters / 1e6:.1f}M parameters, {config.precision.dtype}, "
          f"ZeRO-{config.parallel.zero_stage}, 1 rank, {torch.get_num_threads()} torch threads; host snapshot "
          f"{manager.snapshot_host_bytes / 2**30:.2f} GiB; medians of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; writer nice {async_save.WRITER_NICENESS}")
    rows = [("normal step", normal), ("synchronous save, blocks", sync_block),
            ("background save, blocks", async_block), ("  of which the host snapshot", snapshot),
            ("  its write, in the background", writes), ("step during the write", during)]
    if args.torch_dcp:
        rows += [("torch DCP async_save, blocks", dcp_block), ("  until written", dcp_total),
                 ("  step during its write", dcp_during)]
    for label, seconds in rows:
        print(f"  {label:<32}{median(seconds):8.2f} s")
    print(f"  blocking, background / synchronous: {median(async_block) / median(sync_block):.1%}")
    print(f"  step during the write / normal step: {median(during) / median(normal):.2f}x "
          f"({median(steps_per_write):.0f} steps per background write; normal steps {min(normal):.2f}-"
          f"{max(normal):.2f} s)")
    if training_threads:
        print(f"  training threads' CPU per step, during the write / normal: "
              f"{median(cpu['during']):.2f} / {median(cpu['normal']):.2f} s = "
              f"{median(cpu['during']) / median(cpu['normal']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
