"""Study planning (layouts, refusals) and SLURM scripts run against a faked SLURM environment."""

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lnstrain.study.launchers import run_status, training_command
from lnstrain.study.layout import LayoutError, choose_layout
from lnstrain.study.plan import format_plan, plan_study
from lnstrain.study.runs import compose_run_config
from lnstrain.study.slurm import expand_nodelist, hostfile_text, render_sbatch
from lnstrain.study.spec import ClusterProfile, SlurmOptions, load_study
from lnstrain.testing.tiny_corpus import build_tiny_corpus

REPO = Path(__file__).resolve().parents[2]
STUDIES = REPO / "configs" / "studies"
A100 = ClusterProfile(name="a100", launcher="slurm", gpus_per_node=8, gpu_memory_gib=80, memory_margin=0.85)


def test_shipped_studies_plan_every_run():
    for path in sorted(STUDIES.glob("*.yaml")):
        study = load_study(path)
        planned = plan_study(study)
        assert planned and not [p.error for p in planned if p.error], path
        variants = max(len(study.spec.variants), 1)
        assert len(planned) == len(study.spec.sizes) * variants * len(study.spec.schemes) * len(study.spec.seeds)


def test_1b_never_gets_a_tensor_size_its_ffn_cannot_split():
    study = load_study(STUDIES / "lns_scaling.yaml")
    config = compose_run_config(study, "1b", "lns", 1)
    small_gpu = ClusterProfile(gpus_per_node=8, gpu_memory_gib=12, memory_margin=0.9)
    choice = choose_layout(config, 8, small_gpu)
    assert choice.config.parallel.tensor == 1  # 5461 is odd: memory came from ZeRO/pipeline/recompute instead
    assert any("ffn_hidden_size (5461) must be divisible by parallel.tensor (2)" in n for n in choice.notes)
    assert choice.memory.total <= 12 * 0.9 * 2**30


def test_plan_layout_notes_name_the_sizes_they_are_about():
    study = load_study(STUDIES / "lns_scaling.yaml")
    notes = format_plan(study, plan_study(study)).split("Layout notes")[1].splitlines()[1:]
    assert ("- 1b: tensor 2 skipped: model.ffn_hidden_size (5461) must be divisible by parallel.tensor (2); "
            "model.ffn_multiple_of: 256 rounds it up (LLaMA's rule)") in notes
    assert all(line.startswith("- ") and ": tensor " in line for line in notes if line), notes


def test_plan_refuses_what_does_not_fit(tmp_path):
    study = load_study(STUDIES / "lns_7b.yaml")
    config = compose_run_config(study, "7b", "lns", 1)
    with pytest.raises(LayoutError, match="no layout of 2 GPUs fits 85% of 16 GiB"):
        choose_layout(config, 2, ClusterProfile(gpus_per_node=8, gpu_memory_gib=16, memory_margin=0.85))
    study.spec.gpus_per_run = {"default": 1}
    planned = plan_study(study)
    assert all(p.error for p in planned)
    assert "Refused (no layout fits)" in format_plan(study, planned)
    # the study's output_dir (runs/lns_7b) is relative: from tmp_path, the plan files land there, not in the checkout
    result = subprocess.run([sys.executable, str(REPO / "launch" / "scaling_study.py"), "plan",
                             str(STUDIES / "lns_7b.yaml")], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "7b_lns_s1234" in result.stdout and "GPU-h" in result.stdout
    assert (tmp_path / "runs" / "lns_7b" / "_study" / "plan.json").is_file()


def test_7b_plan_uses_two_nodes_and_fits():
    study = load_study(STUDIES / "lns_7b.yaml")
    [pre_ln, lns] = plan_study(study)
    row = lns.row()
    assert row["gpus"] == 16 and row["tensor"] * row["pipeline"] * row["data"] == 16
    assert row["memory_gib"] <= 80 * 0.85
    assert lns.gpu_hours == pytest.approx(lns.flops / (312e12 * 0.4) / 3600)


def test_expand_nodelist_and_hostfile():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("a[9-10]-ib") == ["a9-ib", "a10-ib"]
    assert hostfile_text(["n1", "n2"], 8) == "n1 slots=8\nn2 slots=8\n"


def test_local_and_deepspeed_commands(tmp_path):
    config = tmp_path / "c.yaml"
    assert training_command(config, 1, ClusterProfile())[1:] == [str(REPO / "launch/pretrain.py"), "--config",
                                                                 str(config)]
    command = training_command(config, 16, ClusterProfile(launcher="deepspeed", gpus_per_node=8,
                                                          hostfile="hosts", master_addr="n1"))
    assert command[:11] == ["deepspeed", "--hostfile", "hosts", "--num_nodes", "2", "--num_gpus", "8",
                            "--master_addr", "n1", "--master_port", "29500"]
    with pytest.raises(ValueError, match="do not fit one node"):
        training_command(config, 16, ClusterProfile(gpus_per_node=8))
    (tmp_path / "elsewhere" / "global_step3").mkdir(parents=True)  # checkpoint.dir outside the run directory
    assert run_status(tmp_path, tmp_path / "elsewhere", 6) == "partial"
    assert run_status(tmp_path, tmp_path / "checkpoints", 6) == "new"


FAKE_SRUN = """#!/bin/bash
# fake srun: run the command once per task of every node with SLURM's per-task variables
per_node=1
while [[ "$1" == --* ]]; do [[ "$1" == --ntasks-per-node=* ]] && per_node=${1#*=}; shift; done
for ((node = 0; node < SLURM_NNODES; node++)); do for ((local = 0; local < per_node; local++)); do
  SLURM_NODEID=$node SLURM_LOCALID=$local SLURM_PROCID=$((node * per_node + local)) \\
  SLURM_NTASKS=$((SLURM_NNODES * per_node)) "$@"
done; done
"""
FAKE_DEEPSPEED = """#!/bin/bash
echo "deepspeed $*" >> "$FAKE_LOG"
"""
FAKE_PYTHON = """#!/bin/bash
if [[ "$1" == launch/slurm/hostfile.py || "$1" == launch/slurm/preemptible.py || "$2" == lnstrain.no_follow ]]; then
  exec {real} "$@"
fi
echo "python $* RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE MASTER=$MASTER_ADDR:$MASTER_PORT" >> "$FAKE_LOG"
"""


def run_fake_slurm(tmp_path: Path, mode: str) -> tuple[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("deepspeed", FAKE_DEEPSPEED),
                       ("fakepython", FAKE_PYTHON.format(real=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    cluster = ClusterProfile(launcher="slurm", gpus_per_node=4, python=str(bin_dir / "fakepython"),
                             env={"NCCL_DEBUG": "WARN"},
                             slurm=SlurmOptions(mode=mode, partition="gpu", setup=["echo setup-ran"]))
    script = render_sbatch("7b_lns_s1", tmp_path, "runs/7b_lns_s1/study_config.yaml", 8, cluster, REPO)
    (tmp_path / "job.sbatch").write_text(script)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path / "log"),
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}
    result = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "setup-ran" in result.stdout
    return script, (tmp_path / "log").read_text()


def test_sbatch_per_node_starts_one_deepspeed_launcher_per_node(tmp_path):
    script, log = run_fake_slurm(tmp_path, "per_node")
    for directive in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                      "#SBATCH --partition=gpu", "#SBATCH --signal=USR1@180", "export NCCL_DEBUG=WARN"):
        assert directive in script
    assert "launch/slurm/preemptible.py -- deepspeed" in script  # the launcher must not kill saving ranks
    lines = log.splitlines()
    assert len(lines) == 2
    for node, line in enumerate(lines):
        assert line.startswith(f"deepspeed --hostfile {tmp_path}/hostfile.4242 --num_nodes 2 --num_gpus 4 "
                               f"--master_addr gpu07 --master_port {20000 + 4242} --no_local_rank --no_ssh "
                               f"--node_rank {node} launch/pretrain.py --config runs/7b_lns_s1/study_config.yaml")
    assert (tmp_path / "hostfile.4242").read_text() == "gpu07 slots=4\ngpu08 slots=4\n"


def test_sbatch_per_rank_gives_every_rank_its_environment(tmp_path):
    script, log = run_fake_slurm(tmp_path, "per_rank")
    assert "#SBATCH --ntasks-per-node=4" in script and "#SBATCH --signal=TERM@180" in script
    lines = log.splitlines()
    assert len(lines) == 8
    for rank, line in enumerate(lines):
        assert f"RANK={rank} LOCAL_RANK={rank % 4} WORLD_SIZE=8 MASTER=gpu07:{20000 + 4242}" in line
        assert "launch/pretrain.py --config runs/7b_lns_s1/study_config.yaml" in line


def test_sbatch_ssh_mode_is_one_launcher(tmp_path):
    _, log = run_fake_slurm(tmp_path, "ssh")
    assert log.count("deepspeed ") == 1 and "--launcher pdsh" in log and "--no_ssh" not in log


@pytest.mark.parametrize("latest, said", [
    (None, "run 'tiny' starts (no checkpoint yet)"),
    ("global_step10\n", "run 'tiny' resumes from global_step10"),
    ("$(touch {marker})\x1b[2J", "run 'tiny' resumes where its checkpoints allow ('latest' is not a plain"),
    ("link", "run 'tiny' resumes where its checkpoints allow ('latest' is not a plain"),
])
def test_the_batch_script_echoes_only_a_plain_latest_into_the_job_log(tmp_path, latest, said):
    """The job log's first line names the step only when ``latest`` is a plain global_step<N>: what else
    it holds (a command, terminal escapes, a link's target) never reaches the log or the shell."""
    from lnstrain.study.slurm import _resume_lines

    checkpoints, marker = tmp_path / "checkpoints", tmp_path / "ran"
    checkpoints.mkdir()
    if latest == "link":
        (tmp_path / "secret").write_text("global_step99\n")
        (checkpoints / "latest").symlink_to(tmp_path / "secret")
    elif latest is not None:
        (checkpoints / "latest").write_text(latest.format(marker=marker))
    lines = _resume_lines("tiny", tmp_path, checkpoints, SlurmOptions(requeue=False))
    result = subprocess.run(["bash", "-c", "train() { return 0; }\nSLURM_JOB_ID=7\n" + "\n".join(lines)],
                            capture_output=True, text=True, check=True)
    first = result.stdout.splitlines()[0]
    assert first.startswith("lnstrain: job 7 restart 0: " + said) and "\x1b" not in first and "99" not in first
    assert not marker.exists()


def test_study_file_problems_are_reported_together(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "sizes": ["60m", "61m"], "schemes": ["lsn"], "data_prefix": "d",
                                    "recipe": str(REPO / "configs/recipes/paper.yaml"),
                                    "sizes_dir": str(REPO / "configs/sizes"),
                                    "schemes_dir": str(REPO / "configs/schemes"), "seeds": []}))
    with pytest.raises(Exception) as error:
        load_study(path)
    text = str(error.value)
    assert "'61m' has no" in text and "'lsn' has no" in text and "seeds is empty" in text


def test_plan_states_its_speed_assumption_and_takes_a_measured_mfu(tmp_path):
    import json

    from lnstrain.config.loader import ConfigError
    from lnstrain.study.plan import measured_speed

    study = load_study(STUDIES / "lns_7b.yaml")
    assumed = plan_study(study)
    text = format_plan(study, assumed)
    assert "Speed: MFU 40.0%, assumed (the study's cluster.mfu), not measured" in text and "--mfu-from" in text
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"environment": {"device_name": "NVIDIA H100 80GB HBM3"},
                                 "shape": {"seq_len": 2048, "model": {"hidden_size": 2048, "num_layers": 24}},
                                 "runners": [{"name": "lnstrain-engine[lns]", "throughput": {"mfu": 0.5}}]}))
    speed = measured_speed(bench)
    measured = plan_study(study, speed)
    assert [p.gpu_hours for p in measured] == pytest.approx([p.gpu_hours * 0.4 / 0.5 for p in assumed])
    assert measured[0].row()["mfu"] == 0.5
    text = format_plan(study, measured, speed)
    assert "measured by tools/benchmark.py (lnstrain-engine[lns] on NVIDIA H100 80GB HBM3, hidden 2048" in text
    assert "GPU-hours at 50.0% MFU (measured)" in text
    bench.write_text(json.dumps({"runners": [{"name": "x", "throughput": {"mfu": None}}]}))
    with pytest.raises(ConfigError, match="no peak TFLOP/s"):
        measured_speed(bench)
    result = subprocess.run([sys.executable, str(REPO / "launch" / "scaling_study.py"), "plan",
                             str(STUDIES / "lns_7b.yaml"), "--mfu-from", str(tmp_path / "absent.json")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "not a tools/benchmark.py --json file" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_without_launching_writes_each_unfinished_runs_config(tmp_path, monkeypatch):
    from lnstrain.config.run_config import load_config
    from lnstrain.study import launchers

    monkeypatch.setattr(launchers, "_launch_here", lambda *a: pytest.fail("launched"))
    corpus = build_tiny_corpus(tmp_path / "corpus")  # the written configs are checked: their files must exist
    study = load_study(STUDIES / "depth_turn.yaml")
    study.spec.output_dir, study.spec.seeds, study.spec.variants = str(tmp_path), [1234], {"short": ["train.steps=6"]}
    study.spec.data_prefix, study.spec.tokenizer = str(corpus.prefix), str(corpus.tokenizer)
    study.spec.set = [f"data.valid_sources=[{{prefix: {corpus.prefix}}}]"]
    planned = plan_study(study)
    finished = planned[0].config.run.dir
    finished.mkdir(parents=True)
    (finished / "final_metrics.json").write_text('{"step": 6, "tokens": 6144, "eval_loss": 5.0, "eval_ppl": 148.4}')
    results = launchers.launch_study(study, planned, launch=False)
    assert [r.status for r in results] == ["finished", "written", "written"]
    written = load_config(results[1].detail)
    assert (written.run.name, written.model.norm_scheme.value, written.train.steps) == (planned[1].run.name, "lns", 6)
    assert not (finished / "study_config.yaml").exists()


def test_the_plan_splits_a_long_sequence_over_context_ranks_before_recomputing_it():
    study = load_study(STUDIES / "lns_7b.yaml")
    config = compose_run_config(study, "7b", "lns", 1)
    short = choose_layout(config, 16, A100).config
    assert short.parallel.context == 1
    long = config.replace(data=dataclasses.replace(config.data, seq_len=131072),
                          model=dataclasses.replace(config.model, max_seq_len=131072),
                          train=dataclasses.replace(config.train, micro_batch_size=1, global_batch_size=16))
    choice = choose_layout(long, 32, A100)  # tensor 8 alone does not fit at 128k tokens without recomputation
    parallel = choice.config.parallel
    assert parallel.context > 1 and choice.config.train.activation_checkpointing != "full", parallel
    assert 131072 // parallel.context >= 4096 and choice.memory.total <= 80 * 0.85 * 2**30
    assert choice.memory.context == parallel.context
