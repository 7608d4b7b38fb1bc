"""launch/gpu_depth_point.sh, the depth-width study's one-call GPU point, run on the CPU on a tiny study of
the same shape of files: it trains both schemes, analyses every checkpoint with the study's collect,
packs what a fresh clone needs, and the analyses it archived regenerate the claims without the
checkpoints. A study whose data is not there is refused before anything runs."""

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from lnstrain.testing.tiny_corpus import build_tiny_corpus

REPO = Path(__file__).resolve().parents[2]


def _study(tmp_path: Path, data_prefix: str, valid_prefix: str, tokenizer: str) -> Path:
    study = tmp_path / "study.yaml"
    study.write_text(f"""
name: gpu_point_check
sizes: [depth12x768]
schemes: [pre_ln, lns]
seeds: [1234]
recipe: {REPO}/configs/recipes/depth_gpu.yaml
sizes_dir: {REPO}/configs/sizes
schemes_dir: {REPO}/configs/schemes
data_prefix: {data_prefix}
tokenizer: {tokenizer}
output_dir: {tmp_path / 'runs'}
cluster: {{name: cpu, launcher: local, gpu_memory_gib: 16, peak_tflops: 1, mfu: 0.5}}
gpus_per_run: {{default: 1}}
search_layout: false
set: [model.vocab_size=256, model.hidden_size=32, model.num_heads=2, model.ffn_hidden_size=88, model.num_layers=4,
      train.steps=8, train.global_batch_size=4, train.micro_batch_size=4, train.eval_interval=4, optim.warmup_steps=2,
      checkpoint.interval_steps=4, logging.interval=2, logging.depth_stats_interval=4, precision.dtype=fp32,
      'data.valid_sources=[{{prefix: {valid_prefix}}}]']
depth:
  data: {valid_prefix}
  steps: [4, 8]
  num_samples: 8
  archive: {tmp_path / 'archive'}
""")
    return study


def _run(study: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "STUDY": str(study), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    return subprocess.run(["bash", "launch/gpu_depth_point.sh", "--output", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_one_call_trains_analyses_and_packs_the_pair(tmp_path):
    corpus = build_tiny_corpus(tmp_path / "corpus")
    study = _study(tmp_path, str(corpus.prefix), str(corpus.prefix), str(corpus.tokenizer))
    result = _run(study, tmp_path / "out")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log = (tmp_path / "out/depth_point.log").read_text()
    assert "depth12x768_lns_s1234: exit 0" in log and "depth12x768_pre_ln_s1234: exit 0" in log
    with tarfile.open(tmp_path / "out/depth_point.tar.gz") as packed:
        names = packed.getnames()
    for run in ("depth12x768_lns_s1234", "depth12x768_pre_ln_s1234"):
        for kept in (f"archive/{run}/step4.json", f"archive/{run}/step8.json", f"runs/{run}/final_metrics.json",
                     f"runs/{run}/train.log"):
            assert any(name.endswith(kept) for name in names), kept
    assert not any("checkpoints" in name for name in names)
    claims = (tmp_path / "runs/_study/depth/claims.csv").read_text()
    assert claims.count("depth12x768,,8,") == 8  # every claim at the last step

    # without the checkpoints (as here after the call): the archive gives the same claims
    for run_dir in (tmp_path / "runs").glob("depth12x768_*"):
        shutil.rmtree(run_dir / "checkpoints")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    again = subprocess.run([sys.executable, "launch/scaling_study.py", "collect", str(study)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "runs/_study/depth/claims.csv").read_text() == claims


def test_a_study_whose_data_is_missing_is_refused_before_anything_runs(tmp_path):
    study = _study(tmp_path, str(tmp_path / "nowhere/train"), str(tmp_path / "nowhere/valid"), str(tmp_path / "t.model"))
    result = _run(study, tmp_path / "out")
    assert result.returncode == 2
    message = f"{tmp_path / 'nowhere/train'}.bin is missing (named by {study})"
    assert message in result.stderr and message not in result.stdout
    assert message in (tmp_path / "out/depth_point.log").read_text()  # the log has it too
    assert not (tmp_path / "runs").exists()
