"""What the depth tool is asked to analyse, resolved and checked before any weight is read.

Each entry (a `--compare` argument, or the one model of `--hf`, `--checkpoint`, `--state-dict`) is
one of: a finished analysis (a `depth_analysis.json` or a folder holding one), a Hugging Face model
directory (config.json with a model_type), or an lnstrain checkpoint (run, checkpoints or
global_step directory). `plan_runs` resolves every entry, names it, reads what can be read without
the weights (the family from config.json, the run's config, the tokenizer), cuts each model's windows
(tokenizing needs only the tokenizer) and loads the multiple-choice task, then checks the entries
against each other: names, groups and windows. It returns every problem at once; only when there
are none does the caller load a model's weights (`PlannedRun.load`), one model at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from lnstrain.analysis.claims import group_problems
from lnstrain.analysis.depth_analysis import DepthAnalysis
from lnstrain.analysis.eval_data import Windows, text_windows, token_file_windows
from lnstrain.analysis.model_source import DepthModel
from lnstrain.analysis.plots import file_stem
from lnstrain.analysis.pruning import MultipleChoiceItem, load_multiple_choice
from lnstrain.analysis.text_tokens import (DocumentTokenizer, SentencePieceDocuments, check_vocabularies_agree,
                                           load_data_tokenizer, load_hf_tokenizer, missing_tokenizer_text)
from lnstrain.analysis.windows import WindowRecord, window_differences
from lnstrain.data.corpus_readers import expand_inputs
from lnstrain.run_files import CHECKPOINTS_DIR, LATEST_FILE

if TYPE_CHECKING:
    from lnstrain.checkpoint.verifier import Trust
    from lnstrain.config.run_config import Config

logger = logging.getLogger(__name__)

HF_DEFAULT_SEQ_LEN = 2048


@dataclass(frozen=True)
class DataOptions:
    """The windows and task every model is measured on (the tool's data options)."""

    text: str | None = None
    data: str | None = None
    data_tokenizer: str | None = None
    tokenizer: str | None = None
    """An lnstrain run's sentencepiece model for --text and --mc-task (default: its data.tokenizer)."""
    seq_len: int | None = None
    """None: the run's data.seq_len; a Hugging Face model's context, at most HF_DEFAULT_SEQ_LEN."""
    num_samples: int = 64
    batch_size: int = 8
    mc_task: str | None = None


@dataclass(frozen=True)
class LoadOptions:
    """How a model's weights are loaded (the tool's precision and placement options)."""

    dtype: str = "fp32"
    device: str = "cpu"
    device_map: str | None = None
    offload_folder: str | None = None
    overrides: tuple[str, ...] = ()
    """--set overrides of a --state-dict run's config."""
    trust: Trust | None = None
    """The opt-ins and key an lnstrain checkpoint is verified with (``lnstrain.checkpoint.verifier``,
    the tool's --allow-pickle, --allow-unverified, --key); None: none."""


@dataclass
class PlannedRun:
    """One entry, ready: a finished analysis, or a model with its windows and a way to load it."""

    given: str
    name: str
    norm_scheme: str
    finished: DepthAnalysis | None = None
    windows: Windows | None = None
    items: list[MultipleChoiceItem] = field(default_factory=list)
    load: Callable[[], DepthModel] | None = None

    @property
    def window_record(self) -> WindowRecord | None:
        return self.finished.windows if self.finished is not None else self.windows.record


@dataclass
class _Model:
    """A model entry as its files describe it, weights not read."""

    given: str
    name: str
    norm_scheme: str
    vocab_size: int
    context: int
    default_seq_len: int
    load: Callable[[], DepthModel]
    hf_path: Path | None = None
    """A Hugging Face model's directory (None: an lnstrain run)."""
    hf_tokenizer: DocumentTokenizer | None = None
    """A Hugging Face model's tokenizer (None when its directory has none)."""
    tokenizer_path: str | None = None
    """An lnstrain run's sentencepiece model, when it has one."""
    default_data: str | None = None

    def has_own_tokenizer(self) -> bool:
        return self.hf_tokenizer is not None if self.hf_path is not None else bool(self.tokenizer_path)

    def own_tokenizer(self, purpose: str) -> DocumentTokenizer:
        """The model's tokenizer for `purpose`, or ValueError saying how to give it one."""
        if self.hf_path is not None:
            if self.hf_tokenizer is None:
                raise ValueError(f"{purpose} needs the model's own tokenizer, but {missing_tokenizer_text(self.hf_path)}: "
                                 "copy the model's tokenizer files into it, or measure on token files with --data "
                                 "and --data-tokenizer")
            return self.hf_tokenizer
        if not self.tokenizer_path:
            raise ValueError(f"{purpose} needs the model's own tokenizer: pass --tokenizer FILE.model (the run's "
                             "config has no data.tokenizer)")
        return SentencePieceDocuments(self.tokenizer_path)


def _looks_like_checkpoint(path: Path) -> bool:
    from lnstrain.checkpoint.metadata import step_of

    if step_of(path) is not None:
        return True
    return any((directory / LATEST_FILE).exists() or any(step_of(child) is not None
                                                         for child in directory.glob("global_step*"))
               for directory in (path, path / CHECKPOINTS_DIR))


def _hf_model(path: Path, load_options: LoadOptions) -> _Model:
    from lnstrain.analysis.hf_source import inspect_hf_directory, load_hf_model

    directory = inspect_hf_directory(path)
    return _Model(str(path), path.resolve().name, directory.norm_scheme, directory.vocab_size, directory.context,
                  min(HF_DEFAULT_SEQ_LEN, directory.context), hf_path=path, hf_tokenizer=load_hf_tokenizer(path),
                  load=lambda: load_hf_model(path, dtype=load_options.dtype, device=load_options.device,
                                             device_map=load_options.device_map,
                                             offload_folder=load_options.offload_folder))


def _lnstrain_model(given: str, config: Config, name: str | None, data: DataOptions, load_options: LoadOptions, *,
                    checkpoint: str | None = None, state_dict: str | None = None,
                    config_path: str | None = None) -> _Model:
    """An lnstrain run, from its config (a checkpoint's saved one, or --config for a state dict)."""
    def load() -> DepthModel:
        from lnstrain.analysis.model_loading import load_for_analysis
        from lnstrain.analysis.model_source import LnstrainDepthModel

        _, model = load_for_analysis(checkpoint=checkpoint, state_dict=state_dict, config=config_path,
                                     overrides=load_options.overrides, device=load_options.device,
                                     trust=load_options.trust)
        return LnstrainDepthModel(model, source=f"lnstrain {'checkpoint' if checkpoint else 'state dict'}, fp32")

    scheme = getattr(config.model.norm_scheme, "value", str(config.model.norm_scheme))
    return _Model(given, name or scheme, scheme, config.model.vocab_size, config.model.max_seq_len,
                  config.data.seq_len, load=load, tokenizer_path=data.tokenizer or config.data.tokenizer or None,
                  default_data=config.data.valid_sources[0].prefix if config.data.valid_sources else None)


def resolve_entry(given: str, data: DataOptions, load_options: LoadOptions) -> DepthAnalysis | _Model:
    """A --compare entry as a finished analysis or a model (ValueError or FileNotFoundError saying why not)."""
    from lnstrain.analysis.hf_source import is_hf_model_directory
    from lnstrain.analysis.report import read_analyses

    path = Path(given)
    if not path.exists():
        raise FileNotFoundError(f"{given} does not exist")
    if path.suffix == ".json" or (path / "depth_analysis.json").is_file():
        try:
            runs = read_analyses(path)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{given}: not a depth analysis written by tools/analyze_depth.py ({e!r} missing or "
                             "malformed)") from e
        if len(runs) != 1:
            raise ValueError(f"{given}: holds {len(runs)} runs; compare single-run analyses")
        return runs[0]
    if is_hf_model_directory(path):
        return _hf_model(path, load_options)
    if (path / "config.json").is_file():
        raise ValueError(f"{given}: config.json has no model_type, so it is not a Hugging Face model directory")
    if not _looks_like_checkpoint(path):
        raise ValueError(f"{given} is none of what --compare takes: not a finished analysis (no depth_analysis.json), "
                         "not a Hugging Face model directory (no config.json), not an lnstrain checkpoint (no "
                         "global_step<N>, latest or checkpoints/ in it)")
    from lnstrain.checkpoint.layouts import read_step_config, resolve_step_dir

    config = read_step_config(resolve_step_dir(path, load_options.trust))
    return _lnstrain_model(given, config, config.run.name, data, load_options, checkpoint=given)


def hf_entry(given: str, load_options: LoadOptions) -> _Model:
    """A --hf directory (ValueError unless it is a Hugging Face model directory)."""
    from lnstrain.analysis.hf_source import read_hf_config

    if "model_type" not in read_hf_config(given):
        raise ValueError(f"{given}: config.json has no model_type, so it is not a Hugging Face model directory")
    return _hf_model(Path(given), load_options)


def state_dict_entry(state_dict: str, config_path: str, data: DataOptions, load_options: LoadOptions) -> _Model:
    """A --state-dict file and its run config (read now; the weights when loaded)."""
    from lnstrain.config.run_config import load_config

    if not Path(state_dict).is_file():
        raise FileNotFoundError(f"--state-dict {state_dict} does not exist")
    config = load_config(config_path, list(load_options.overrides), validate=False)
    return _lnstrain_model(state_dict, config, None, data, load_options, state_dict=state_dict, config_path=config_path)


def checkpoint_entry(checkpoint: str, data: DataOptions, load_options: LoadOptions) -> _Model:
    """A --checkpoint (single run: named by its norm scheme, as before)."""
    from lnstrain.checkpoint.layouts import read_step_config, resolve_step_dir

    config = read_step_config(resolve_step_dir(checkpoint, load_options.trust))
    return _lnstrain_model(checkpoint, config, None, data, load_options, checkpoint=checkpoint)


def _token_file_windows(model: _Model, data: DataOptions, prefix: str, seq_len: int,
                        made_by: DocumentTokenizer | None) -> Windows:
    """--data for a model: its tokenizer checked against the one that made the file (`made_by`, from
    --data-tokenizer) when both are known."""
    if made_by is not None:
        if model.has_own_tokenizer():
            check_vocabularies_agree(made_by, model.own_tokenizer("--data-tokenizer"), prefix)
    elif model.hf_tokenizer is not None:
        raise ValueError(f"--data {prefix}: token files do not say which tokenizer made them, and {model.name} is a "
                         "Hugging Face model with its own: pass --data-tokenizer (the sentencepiece .model or "
                         "tokenizer directory that made them) to check that they agree, or --text FILE.jsonl to "
                         "tokenize text with the model's tokenizer")
    elif model.hf_path is not None:
        logger.warning("%s has no tokenizer: --data %s is checked only against the vocabulary size", model.name, prefix)
    return token_file_windows(prefix, seq_len, data.num_samples, data.batch_size, model.vocab_size, made_by)


def _windows_and_items(model: _Model, data: DataOptions, data_tokenizer: DocumentTokenizer | None
                       ) -> tuple[Windows, list[MultipleChoiceItem]]:
    seq_len = data.seq_len or model.default_seq_len
    if seq_len > model.context:
        given = f"--seq-len {seq_len}" if data.seq_len else f"the default window length {seq_len} (set --seq-len)"
        raise ValueError(f"{given} is longer than {model.name}'s context of {model.context} tokens")
    if data.text:
        windows = text_windows(data.text, model.own_tokenizer("--text"), seq_len, data.num_samples, data.batch_size,
                               model.vocab_size)
    else:
        prefix = data.data or model.default_data
        if prefix is None:
            raise ValueError("no validation data: pass --data PREFIX or --text FILE (the model has no "
                             "data.valid_sources)")
        windows = _token_file_windows(model, data, prefix, seq_len, data_tokenizer)
    items = []
    if data.mc_task:
        tokenizer = model.own_tokenizer("--mc-task")
        items = load_multiple_choice(data.mc_task, tokenizer.encode, context_prefix=tokenizer.question_prefix(),
                                     encode_choice=tokenizer.continuation)
    return windows, items


def data_problems(data: DataOptions) -> list[str]:
    """The data options' own files, checked once for every model."""
    problems = []
    if data.text:
        try:
            expand_inputs([data.text])
        except FileNotFoundError as e:
            problems.append(f"--text: {e}")
    if data.data and not (Path(f"{data.data}.bin").is_file() and Path(f"{data.data}.idx").is_file()):
        problems.append(f"--data {data.data}: no {data.data}.bin and .idx (token files made by tools/preprocess_data.py)")
    for flag, path in (("--mc-task", data.mc_task), ("--data-tokenizer", data.data_tokenizer),
                       ("--tokenizer", data.tokenizer)):
        if path and not Path(path).exists():
            problems.append(f"{flag} {path} does not exist")
    return problems


def plan_runs(entries: Sequence[Callable[[], DepthAnalysis | _Model]], given: Sequence[str],
              names: Sequence[str | None], data: DataOptions, *, groups: Sequence[str] | None = None,
              allow_different_windows: bool = False) -> tuple[list[PlannedRun], list[str]]:
    """(the entries ready to analyse, every problem found). `entries`: one resolver per entry
    (`resolve_entry`, `state_dict_entry`, `checkpoint_entry` with their arguments bound); `given`: how
    each was given, for the messages; `names`: the display names asked for (None: the default)."""
    problems = data_problems(data)
    data_sound = not problems  # windows need the data options to be sound
    data_tokenizer = None
    if data.data_tokenizer and data_sound:
        try:
            data_tokenizer = load_data_tokenizer(data.data_tokenizer)
        except (ValueError, FileNotFoundError) as e:
            problems.append(f"--data-tokenizer: {e}")
    planned: list[PlannedRun] = []
    for resolve, where, name in zip(entries, given, names):
        try:
            resolved = resolve()
            if isinstance(resolved, DepthAnalysis):
                resolved.name = name or resolved.name
                planned.append(PlannedRun(where, resolved.name, resolved.norm_scheme, finished=resolved))
                continue
            run = PlannedRun(where, name or resolved.name, resolved.norm_scheme, load=resolved.load)
            if data_sound:
                run.windows, run.items = _windows_and_items(resolved, data, data_tokenizer)
            planned.append(run)
        except (ValueError, FileNotFoundError) as e:
            problems.append(str(e) if str(e).startswith(where) else f"{where}: {e}")
    stems: dict[str, list[PlannedRun]] = {}
    for run in planned:
        stems.setdefault(file_stem(run.name), []).append(run)
    for same in (runs for runs in stems.values() if len(runs) > 1):
        problems.append(f"several runs are named {', '.join(sorted({r.name for r in same}))} "
                        f"({', '.join(r.given for r in same)}); give each its own name with --names (one per run)")
    if len(planned) < len(given):
        return planned, problems
    if groups is not None:
        problems += group_problems([r.name for r in planned], [r.norm_scheme for r in planned], groups)
    if not problems and len(planned) > 1:
        differences = window_differences([(r.name, r.window_record) for r in planned])
        if differences and not allow_different_windows:
            problems.append("the runs were not measured on the same windows, so their figures cannot be compared:\n    "
                            + "\n    ".join(differences) + "\n  Measure them on the same windows (the same --text or "
                            "--data, --seq-len and --num-samples; the same tokenizer), or pass "
                            "--allow-different-windows to compare them anyway (the report then says they differ)")
        elif differences:
            logger.warning("the runs were not measured on the same windows (--allow-different-windows): %s",
                           "; ".join(differences))
    return planned, problems
