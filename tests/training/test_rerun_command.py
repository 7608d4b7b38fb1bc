"""The command a stopped run says to rerun: the script's, the launcher's above the rank, or the rank's own."""

from __future__ import annotations

from lnstrain.training.rerun_command import launcher_command, resume_command

RANK = ["launch/pretrain.py", "--local_rank=1", "--config", "configs/demo.yaml", "--stop-at-step", "40",
        "--set", "run.name=my run"]


def fake_processes(table: dict[int, tuple[list[str], int]]):
    return lambda pid: table.get(pid)


def test_a_plain_launch_reruns_its_own_command_without_the_one_shot_options():
    assert resume_command(RANK, environ={}) == "python launch/pretrain.py --config configs/demo.yaml --set 'run.name=my run'"


def test_a_script_that_names_its_command_wins():
    assert resume_command(RANK, environ={"LNSTRAIN_RESUME_COMMAND": "bash launch/train.sh"}) == "bash launch/train.sh"


def test_under_the_deepspeed_launcher_the_outermost_launcher_command_is_found_among_the_ancestors():
    ranks_launcher = ["/venv/bin/python", "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", *RANK]
    runner = ["/venv/bin/python", "/venv/bin/deepspeed", "--master_port", "29600", "--num_gpus", "2",
              "launch/pretrain.py", "--config", "configs/demo.yaml", "--stop-at-step=40"]
    table = {10: (["/venv/bin/python", "-u", *RANK], 9), 9: (ranks_launcher, 8), 8: (runner, 7),
             7: (["-bash"], 1)}
    found = launcher_command(fake_processes(table), pid=10)
    assert found == ["deepspeed", *runner[2:]]
    command = resume_command(RANK, environ={"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, launcher=lambda: found)
    assert command == "deepspeed --master_port 29600 --num_gpus 2 launch/pretrain.py --config configs/demo.yaml"
    table[7] = (["/usr/bin/python3", "launch/slurm/preemptible.py", "--", *runner[1:]], 6)  # under the wrapper
    assert launcher_command(fake_processes(table), pid=10)[0] == "python launch/slurm/preemptible.py"
    assert resume_command(RANK, environ={"LOCAL_RANK": "1"}, launcher=lambda: None) == "the same launch command"
