"""When and where checkpoints are written, and what a run resumes from."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    """Checkpointing.

    Attributes:
        dir: checkpoint directory; default ``<run dir>/checkpoints``.
        interval_steps: save every this many steps; 0 disables step-based saves.
        interval_minutes: also save when this many minutes passed since the last save.
        keep_last: keep only the newest N checkpoints (the one ``latest`` names is never deleted);
            unset keeps all.
        resume: ``auto`` (resume from the checkpoint directory's ``latest`` if there is one),
            ``none`` (start fresh; refuses to overwrite existing checkpoints) or a path to a run's
            checkpoint directory or one ``global_stepN`` directory.
        save_at_end: save when the run finishes.
        allow_data_mismatch: resume even if the data fingerprint or tokenizer checksum changed.
        init_from: start a fresh run from these weights (continued pretraining): a consolidated
            ``.safetensors``/``.pt`` state dict, a Hugging Face LLaMA directory or an lnstrain
            checkpoint of any layout; loaded with ``lnstrain.checkpoint.consolidated_file.load_init_state_dict``.
            Ignored when the run resumes from its own checkpoint.
        init_from_unfold_lns: for a Hugging Face ``init_from``: divide out the LNS factors an lnstrain
            export folded into the weights (``true``), load the weights as they are (``false``), or, unset,
            do what the export's config.json records (``lnstrain.checkpoint.lns_fold``; the log says which).
        reshard_with_fresh_optimizer: resuming at another (tensor, pipeline, data) layout needs the
            Adam moments, which only ZeRO-1/2 checkpoints give back; set this to resume a ZeRO-0/3
            checkpoint at another layout with the weights, schedule and data position and fresh
            (zero) optimizer moments.
        allow_pickle: trust this run's checkpoints: load DeepSpeed's files even where their pickle
            names classes beyond the allow-list (``--allow-pickle``; docs/checkpoints.md).
        allow_unverified: use a checkpoint whose files cannot be verified: one saved by an lnstrain
            before checksums, or, with ``signing_key_file``, an unsigned one (``--allow-unverified``).
            A damaged or forged checkpoint is never used.
        signing_key_file: a file holding a secret key (at least 32 bytes, mode 600, outside the run
            and checkpoint directories). Each save signs its completion marker with it (HMAC-SHA256
            of every file's name, size and SHA-256), and a resume uses only checkpoints signed with
            it: anyone who can write the run directory but not read the key cannot make a
            checkpoint this run loads. Unset (the default): no signatures.
        verify_checksums: on resume, compare every file's SHA-256 with what its save recorded (one
            extra read of the checkpoint before loading it). ``false`` checks sizes and the pickle
            scan only: for very large checkpoints on a slow file system, at the price of loading a
            file whose bytes changed but not its size.
        async_save: write checkpoints in the background: a save copies the state to host memory at
            the step boundary and training goes on while a thread writes, hashes and fsyncs the files;
            the checkpoint becomes ``latest`` at a later step boundary, once every rank's files are
            written (docs/checkpoints.md, "Saves in the background"). Unset (the default): on, unless
            the ``deepspeed:`` section selects another DeepSpeed checkpoint engine, which saves
            synchronously with a warning; a snapshot that does not fit in host memory is written at
            once instead, with a warning. ``true``: on, and a run where it cannot be stops before it
            starts (exit 2). ``false``: every save blocks training until its files are written.
    """

    dir: str | None = None
    interval_steps: int = 1000
    interval_minutes: float | None = None
    keep_last: int | None = None
    resume: str = "auto"
    save_at_end: bool = True
    allow_data_mismatch: bool = False
    init_from: str | None = None
    init_from_unfold_lns: bool | None = None
    reshard_with_fresh_optimizer: bool = False
    allow_pickle: bool = False
    allow_unverified: bool = False
    signing_key_file: str | None = None
    verify_checksums: bool = True
    async_save: bool | None = None

    def validate(self) -> list[str]:
        problems = []
        if self.interval_steps < 0:
            problems.append(f"checkpoint.interval_steps must be >= 0 (got {self.interval_steps})")
        if self.interval_minutes is not None and self.interval_minutes <= 0:
            problems.append(f"checkpoint.interval_minutes must be > 0 (got {self.interval_minutes})")
        if self.keep_last is not None and self.keep_last < 1:
            problems.append(f"checkpoint.keep_last must be >= 1 (got {self.keep_last})")
        if self.init_from is not None and not os.path.exists(self.init_from):
            problems.append(f"checkpoint.init_from: {self.init_from} does not exist (give a .safetensors or .pt "
                            "state dict, a Hugging Face LLaMA directory or an lnstrain checkpoint directory)")
        return problems
