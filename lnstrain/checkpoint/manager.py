"""Saving, finding, loading and pruning checkpoints so that a kill at any moment loses nothing saved.

A save is: every rank checks that its weights and optimizer state are finite (else nothing is
saved); every rank writes its DeepSpeed shards and its RNG file, hashing them as they are written;
rank 0 writes the metadata; every rank fsyncs; gathering every rank's file records proves all ranks
are done; only then rank 0 writes the completion marker (with those records) and replaces ``latest``
atomically. Until that last rename, ``latest`` names the previous checkpoint, which is untouched, so
an interrupted save costs only the interrupted step's work. With ``checkpoint.async_save`` the files
are written by a thread from a snapshot taken at the step boundary, and the same publication happens
at a later step boundary, on the main thread (``lnstrain.checkpoint.async_save``).

A load first verifies the checkpoint's files against their records, each rank a share
(``verified_checkpoint``), falling back to the newest older checkpoint that verifies, and then reads
every file with ``weights_only`` (``lnstrain.checkpoint.safe_load``).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

import lnstrain
from lnstrain.checkpoint import save_points
from lnstrain.checkpoint.async_save import BackgroundWrite, SnapshotBuffers, staging_deepspeed_files
from lnstrain.checkpoint.errors import CheckpointError
from lnstrain.checkpoint.finite_state import nonfinite_state
from lnstrain.checkpoint.integrity import FileRecord, file_record, recording_deepspeed_files, write_marker
from lnstrain.checkpoint.locations import complete_step_dirs, newest_checkpoint, read_latest, remove_links
from lnstrain.checkpoint.metadata import (CONFIG_FILE, COMPLETE_MARKER, METADATA_FILE, CheckpointMetadata,
                                          capture_rng_state, fsync_tree, is_complete, load_rng_state, read_metadata,
                                          restore_rng_state, rng_file, save_rng_state, step_dir_name, step_of,
                                          write_atomically)
from lnstrain.checkpoint.safe_load import loading_safely
from lnstrain.checkpoint.save_agreement import HeldFailure, holding_deepspeed_failures, raise_if_any_failed
from lnstrain.checkpoint.verifier import Trust, Verdict, check_step_dir, choose_checkpoint
from lnstrain.run_files import LATEST_FILE

if TYPE_CHECKING:
    from lnstrain.training.engine import TrainingEngine

logger = logging.getLogger(__name__)

CLIENT_STATE_KEY = "lnstrain_position"
"""Under this key each save also gives its ``TrainingPosition`` to DeepSpeed's model-states file."""


def data_mismatch_problems(metadata: CheckpointMetadata, step_dir: Path, data_fingerprint: str | None,
                           tokenizer_checksum: str | None) -> list[str]:
    """Problems when the checkpoint was trained on other data or with another tokenizer than this run."""
    problems = []
    hint = "set checkpoint.allow_data_mismatch: true to resume anyway"
    if metadata.data_fingerprint != data_fingerprint:
        problems.append(f"data changed since {step_dir}: the checkpoint's data fingerprint is "
                        f"{metadata.data_fingerprint}, this run's is {data_fingerprint} (data.sources, "
                        f"their files, data.seq_len, data.mode or the split changed); {hint}")
    if metadata.tokenizer_checksum != tokenizer_checksum:
        problems.append(f"tokenizer changed since {step_dir}: the checkpoint's tokenizer checksum is "
                        f"{metadata.tokenizer_checksum}, this run's (data.tokenizer) is {tokenizer_checksum}; {hint}")
    return problems


def position_problems(metadata: CheckpointMetadata, saved: Any, step_dir: Path) -> list[str]:
    """Where the metadata's training position differs from the one the save also gave DeepSpeed
    (``client_state``, in the model-states file). Both are written from one position by one save, so
    a difference means one was rewritten (with its checksum: a run without a signing key). ``saved``:
    the ``CLIENT_STATE_KEY`` entry of the model-states file."""
    if not isinstance(saved, dict):
        return []  # not a checkpoint lnstrain saved through DeepSpeed
    return [f"{step_dir / METADATA_FILE} says {name} {getattr(metadata, name)!r}, but the position the same save "
            f"gave DeepSpeed says {saved.get(name)!r}: one of the two files was rewritten after the save; use "
            "another checkpoint (tools/verify_checkpoint.py lists them)"
            for name in ("step", "consumed_samples", "tokens_seen") if saved.get(name) != getattr(metadata, name)]


def apply_retention(checkpoint_dir: str | Path, keep_last: int | None) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep_last``; never the one ``latest`` names,
    never anything newer than it, never an incomplete directory. Returns what was deleted."""
    if keep_last is None:
        return []
    latest = read_latest(checkpoint_dir)
    if latest is None or not is_complete(latest):
        return []
    latest_step = step_of(latest)
    complete = complete_step_dirs(checkpoint_dir)
    keep = {p.name for p in complete[-keep_last:]} | {latest.name}
    deleted = []
    for step_dir in complete:
        if step_dir.name in keep or step_of(step_dir) >= latest_step:
            continue
        (step_dir / COMPLETE_MARKER).unlink()  # first, so a half-deleted directory reads as incomplete
        save_points.reached("old checkpoint marked incomplete", step_dir)
        shutil.rmtree(step_dir)
        deleted.append(step_dir)
    return deleted


# --- saving and loading (collective: every rank calls these) ----------------------------------------
@dataclass
class TrainingPosition:
    """Where a run stands; what a checkpoint restores besides the weights and optimizer."""

    step: int = 0
    consumed_samples: int = 0
    tokens_seen: int = 0
    skipped_sample_ranges: list[list[int]] = field(default_factory=list)
    """[start, end) consumed-sample ranges the run never trains on (``train.nonfinite_policy: rollback``)."""
    nonfinite_steps: int = 0
    loss_spikes: int = 0
    skipped_batches: int = 0

    @classmethod
    def from_metadata(cls, metadata: CheckpointMetadata) -> "TrainingPosition":
        return cls(metadata.step, metadata.consumed_samples, metadata.tokens_seen,
                   [list(r) for r in metadata.skipped_sample_ranges], metadata.nonfinite_steps, metadata.loss_spikes, metadata.skipped_batches)


@dataclass(frozen=True)
class OwnFiles:
    """What lnstrain writes into a checkpoint beside DeepSpeed's files, as it was at the step boundary."""

    rng_state: dict[str, Any]
    metadata: str
    config: str


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _global_rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order (collective)."""
    if _world_size() == 1:
        return [value]
    everyone: list[Any] = [None] * _world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def verify_collectively(step_dir: Path, trust: Trust) -> Verdict:
    """``check_step_dir`` of ``step_dir``, each rank checking a share of its files; every rank gets the
    same merged verdict (collective)."""
    verdict = Verdict(step_dir)
    for share in _gather(check_step_dir(step_dir, trust, (_global_rank(), _world_size()))):
        verdict.merge(share)
    return verdict


class CheckpointManager:
    """Saves and loads this run's checkpoints under ``config.checkpoint_dir``.

    Args:
        config: the resolved run config (written into each checkpoint).
        layout: (tensor, pipeline, data) parallel sizes; their product is the number of ranks. Data
            counts data × context ranks, those DeepSpeed's files are written for.
        data_fingerprint, tokenizer_checksum: this run's, stored and compared on resume.
    """

    def __init__(self, config: Any, layout: tuple[int, int, int], data_fingerprint: str | None,
                 tokenizer_checksum: str | None) -> None:
        self.config = config
        self.directory = Path(config.checkpoint_dir)
        self.layout = layout
        tensor, pipeline, data = layout
        self.world_size = tensor * pipeline * data
        self.data_fingerprint = data_fingerprint
        self.tokenizer_checksum = tokenizer_checksum
        self.trust = Trust.from_config(config.checkpoint, [config.run.dir, self.directory])
        """The opt-ins and signing key every load verifies with; the key also signs every save."""
        self.last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self.slowest_save_s = 0.0
        """The longest a save took from its start to its publication, the time training spent in it or not."""
        self.in_flight: BackgroundWrite | None = None
        """The save whose files a thread is writing (at most one), published at a later step boundary."""
        self._snapshot_buffers = SnapshotBuffers()

    @property
    def snapshot_host_bytes(self) -> int:
        """Host memory this rank keeps for the snapshots of saves written in the background."""
        return self._snapshot_buffers.held_bytes

    def metadata(self, position: TrainingPosition, lr_schedule: dict[str, Any] | None = None) -> CheckpointMetadata:
        tp, pp, dp = self.layout
        return CheckpointMetadata(
            step=position.step, consumed_samples=position.consumed_samples, tokens_seen=position.tokens_seen,
            data_fingerprint=self.data_fingerprint, tokenizer_checksum=self.tokenizer_checksum,
            lnstrain_version=lnstrain.__version__, world_size=self.world_size, tensor_parallel=tp,
            pipeline_parallel=pp, data_parallel=dp, zero_stage=self.config.parallel.zero_stage,
            precision=self.config.precision.dtype, skipped_sample_ranges=[list(r) for r in position.skipped_sample_ranges],
            nonfinite_steps=position.nonfinite_steps, loss_spikes=position.loss_spikes,
            skipped_batches=position.skipped_batches, lr_schedule=lr_schedule)

    def save(self, engine: TrainingEngine, position: TrainingPosition, in_background: bool = False) -> Path | None:
        """Write checkpoint ``global_step<step>`` on every rank, then publish it as ``latest``.

        Returns None, writing nothing, when any rank's weights or optimizer state are not finite.
        ``in_background`` (``checkpoint.async_save``): return once the state is snapshotted; a thread
        writes the files, and ``publish_if_written`` or ``finish_background_save`` publishes them at a
        later step boundary. A save still in flight is finished first: at most one is.
        """
        self.finish_background_save(f"the save of step {position.step} waits for it (saves come faster than "
                                    "they are written)", warn=True)
        started = time.monotonic()
        rank = _global_rank()
        step_dir = self.directory / step_dir_name(position.step)
        nonfinite = nonfinite_state(engine)
        if nonfinite:
            shown = "; ".join(nonfinite[:5]) + (f"; and {len(nonfinite) - 5} more" if len(nonfinite) > 5 else "")
            logger.error("NOT saving %s: the weights or optimizer state are not finite (%s); latest still names "
                         "%s", step_dir, shown, read_latest(self.directory) or "no checkpoint")
            return None
        save_points.reached("save started", step_dir)
        held = HeldFailure()
        if rank == 0:
            with held.catching():
                self.directory.mkdir(parents=True, exist_ok=True)
                remove_links(self.directory)  # DeepSpeed and this save would write through them
                if step_dir.exists():  # an interrupted save, or a step redone after resuming from an older one
                    (step_dir / COMPLETE_MARKER).unlink(missing_ok=True)
                    save_points.reached("stale step directory marked incomplete", step_dir)
                    shutil.rmtree(step_dir)
        self._agree(held, step_dir)
        background = BackgroundWrite(step_dir, held, self._snapshot_buffers) if in_background else None
        staging = (staging_deepspeed_files(engine.checkpoint_files, background) if background
                   else contextlib.nullcontext())
        with recording_deepspeed_files(engine.checkpoint_files, step_dir, rank) as records, \
                save_points.around_deepspeed_files(engine.checkpoint_files), staging, \
                holding_deepspeed_failures(engine.checkpoint_files, held):
            engine.save_checkpoint(step_dir, client_state={CLIENT_STATE_KEY: vars(position)})
        own_files = OwnFiles(capture_rng_state(), self.metadata(position, engine.lr_schedule_record()).to_json(), self.config.to_yaml())
        if background is not None:  # published by publish_if_written or finish_background_save
            background.start(records, lambda: self._write_own_files(step_dir, rank, own_files, records),
                             blocking_seconds=time.monotonic() - started)
            self.in_flight = background
        else:
            if held.error is None:
                with held.catching():
                    self._write_own_files(step_dir, rank, own_files, records)
            self._publish(held, step_dir, records)
            seconds = time.monotonic() - started
            self.slowest_save_s = max(self.slowest_save_s, seconds)
            logger.info("saved checkpoint %s in %.1f s", step_dir, seconds)
        self.last_save_time = time.monotonic()
        self.last_saved_step = position.step
        return step_dir

    def publish_if_written(self) -> Path | None:
        """Publish the save in flight if every rank's thread has written its files; the checkpoint
        published, else None. Collective: every rank calls it at the same step boundary."""
        if self.in_flight is None or not all(_gather(self.in_flight.done)):
            return None
        return self.finish_background_save()

    def finish_background_save(self, why: str = "", warn: bool = False) -> Path | None:
        """Wait for the save in flight (the wait is logged with its length and ``why``) and publish it;
        the checkpoint published, or None when none was in flight. A write that failed on any rank
        raises here, on every rank, as a synchronous save does. Collective."""
        background, self.in_flight = self.in_flight, None
        if background is None:
            return None
        if not background.done:
            waited = background.wait()
            (logger.warning if warn else logger.info)("waited %.1f s for the background write of %s%s", waited,
                                                      background.step_dir, f": {why}" if why else "")
        publishing = time.monotonic()
        self._publish(background.held, background.step_dir, background.records)
        seconds = background.blocking_seconds + background.write_seconds + time.monotonic() - publishing
        self.slowest_save_s = max(self.slowest_save_s, seconds)
        logger.info("saved checkpoint %s: training blocked %.1f s, the files took %.1f s in the background",
                    background.step_dir, background.blocking_seconds, background.write_seconds)
        return background.step_dir

    def _publish(self, held: HeldFailure, step_dir: Path, records: dict[str, FileRecord]) -> None:
        """Every rank's files are written: gather their records (which proves it), then rank 0 writes
        the completion marker and ``latest`` and applies retention. Collective."""
        rank = _global_rank()
        every_file: dict[str, FileRecord] = {}
        for rank_records in self._agree(held, step_dir, records):  # also proves every rank's files are written
            every_file.update(rank_records)
        save_points.reached("every rank finished writing", step_dir)
        if rank == 0:
            with held.catching():
                write_marker(step_dir, every_file, self.trust.key)
                write_atomically(self.directory / LATEST_FILE, step_dir.name + "\n")
                for deleted in apply_retention(self.directory, self.config.checkpoint.keep_last):
                    logger.info("deleted old checkpoint %s (checkpoint.keep_last=%s)", deleted,
                                self.config.checkpoint.keep_last)
        self._agree(held, step_dir)

    def _write_own_files(self, step_dir: Path, rank: int, own: OwnFiles, records: dict[str, FileRecord]) -> None:
        """This rank's RNG file (rank 0: metadata and config), recorded; then every file fsynced."""
        save_rng_state(step_dir, rank, own.rng_state)
        save_points.reached("RNG state written", step_dir)
        own_files = [rng_file(step_dir, rank)]
        if rank == 0:
            write_atomically(step_dir / METADATA_FILE, own.metadata)
            write_atomically(step_dir / CONFIG_FILE, own.config)
            own_files += [step_dir / METADATA_FILE, step_dir / CONFIG_FILE]
        for path in own_files:  # small: read back
            records[path.relative_to(step_dir).as_posix()] = file_record(path, rank)
        fsync_tree(step_dir)
        save_points.reached("step directory fsynced", step_dir)

    def _agree(self, held: HeldFailure, step_dir: Path, payload: Any = None) -> list[Any]:
        """End a phase of the save on every rank: every rank's ``payload`` in rank order, or, when any
        rank's phase failed, the same error raised on every rank (collective)."""
        report = held.report(_global_rank(), step_dir, newest_checkpoint(self.directory)) if held.error else None
        gathered = _gather((payload, report))
        raise_if_any_failed([rank_report for _, rank_report in gathered], held, _world_size())
        return [rank_payload for rank_payload, _ in gathered]

    def verified_checkpoint(self, step_dir: Path, fall_back: bool) -> tuple[Path | None, list[str]]:
        """(the checkpoint to load, problems of those skipped): ``step_dir`` if it verifies
        (``verifier``), else (``fall_back``) the newest older complete checkpoint beside it that does;
        None when none does. Collective: every rank checks a share of the files and all agree.

        Raises ``CheckpointError`` (agreed by every rank) when a file's pickle names classes beyond the
        allow-list and the checkpoint is not trusted (``checkpoint.allow_pickle``): that is never
        silently skipped.
        """
        choice = choose_checkpoint(step_dir, self.trust, fall_back, lambda d: verify_collectively(d, self.trust),
                                   log=_global_rank() == 0)  # every rank holds the same merged verdicts
        if choice.refusal:
            raise CheckpointError(choice.refusal, agreed=True)
        return choice.step_dir, choice.skipped

    def load(self, engine: TrainingEngine, step_dir: Path) -> TrainingPosition:
        """Restore weights, optimizer, schedule, RNG and the data position from ``step_dir`` (saved at
        this layout)."""
        metadata = read_metadata(step_dir)
        self.check_same_data(step_dir)
        with loading_safely(engine.checkpoint_files, self.config.checkpoint.allow_pickle):
            client_state = engine.load_checkpoint(step_dir)
        if client_state is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {step_dir}")
        disagreements = [problem for problems in _gather(position_problems(metadata, client_state.get(CLIENT_STATE_KEY), step_dir))
                         for problem in problems]
        if disagreements:
            raise CheckpointError("cannot resume:\n  - " + "\n  - ".join(dict.fromkeys(disagreements)), agreed=True)
        rank = _global_rank()
        rng_state = load_rng_state(step_dir, rank)
        if rng_state is not None and metadata.world_size == self.world_size:
            restore_rng_state(rng_state)
        else:
            logger.warning("%s was saved by %d ranks, this run has %d: RNG states are not restored for "
                           "rank %d (dropout masks differ from the uninterrupted run)",
                           step_dir, metadata.world_size, self.world_size, rank)
        self.mark_loaded(metadata)
        logger.info("resumed from %s: step %d, %d samples consumed", step_dir, metadata.step,
                    metadata.consumed_samples)
        return TrainingPosition.from_metadata(metadata)

    def mark_loaded(self, metadata: CheckpointMetadata) -> None:
        """Record that the engine now holds the checkpoint ``metadata`` describes (nothing to save yet)."""
        self.last_saved_step = metadata.step
        self.last_save_time = time.monotonic()

    def check_same_data(self, step_dir: Path) -> None:
        """Raise unless ``step_dir`` was trained on this run's data and tokenizer (or mismatches are allowed)."""
        if self.config.checkpoint.allow_data_mismatch:
            return
        problems = data_mismatch_problems(read_metadata(step_dir), step_dir, self.data_fingerprint,
                                          self.tokenizer_checksum)
        if problems:
            raise CheckpointError("cannot resume:\n  - " + "\n  - ".join(problems), agreed=True)
