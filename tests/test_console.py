"""The ``r3l`` script (``r3lightning.cli.console``): the command list, the refusal of LightningCLI's
``test``/``predict`` and a cached ``r3l fit --help`` come without importing Lightning or torch; the
help opens with r3lightning's own sections; Trainer flags that manual optimization ignores are refused
with the key to use."""

import copy
import os
import subprocess
import sys

import pytest
import yaml
from harness import TINY_CLI_RUN

from r3lightning.cli import console

def run_console(args, cache, timeout=300):
    """``r3lightning.cli.console.main(args)`` in a fresh interpreter; its last stderr line is the exit status
    followed by the heavy packages it imported."""
    code = f"""
import sys
from r3lightning.cli.console import main
try:
    main({args!r})
    code = 0
except SystemExit as done:
    code = done.code
print(code, *[m for m in ("lightning", "torch", "transformers") if m in sys.modules], file=sys.stderr)
"""
    env = {**os.environ, "R3L_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "COLUMNS": "100"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    return done, done.stderr.strip().splitlines()[-1]


def test_the_command_list_names_every_command_and_imports_nothing_heavy(tmp_path):
    done, status = run_console(["--help"], tmp_path)
    assert status == "0", done.stderr  # exit status 0, no lightning/torch/transformers imported
    for name in ("fit", "validate", "export", "gnt-pool", "reflect-sft"):
        assert f"\n  {name} " in done.stdout
    assert "test" not in done.stdout.split("commands:")[1] and "predict" not in done.stdout


def test_the_console_and_the_lightning_cli_agree_on_the_commands():
    from r3lightning.cli.main import R3LightningCLI

    assert set(R3LightningCLI.subcommands()) == set(console.LIGHTNING_COMMANDS)
    assert set(console.LIGHTNING_COMMANDS) < set(console.COMMANDS)
    assert not set(console.REFUSED_COMMANDS) & set(console.COMMANDS)


@pytest.mark.parametrize("command, instead", [("test", "r3l validate --ckpt_path"), ("predict", "r3l export")])
def test_test_and_predict_are_refused_in_one_line(command, instead, capsys):
    with pytest.raises(SystemExit) as exit_:
        console.main([command, "--config", "x.yaml"])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"r3l: error: 'r3l {command}' is not a command of r3l") and instead in lines[0]


def test_fit_help_is_built_once_then_served_from_the_cache_without_lightning(tmp_path):
    first, status = run_console(["fit", "--help"], tmp_path)
    assert status.startswith("0 "), first.stderr  # built by the real parser: Lightning imported
    again, status = run_console(["fit", "--help"], tmp_path)
    assert status == "0", again.stderr  # served from the cache: nothing heavy imported
    assert again.stdout == first.stdout and len(list(tmp_path.glob("help-fit-*.txt"))) == 1
    text = first.stdout
    # r3lightning's own sections come before the Trainer's flags.
    assert text.index("\n  --model.") < text.index("\n  --data.") < text.index("\n  --trainer.")


def test_the_help_cache_key_follows_the_sources_and_the_arguments(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    key = console.help_cache_key(["r3l", "fit", "--help"], [tmp_path], 100)
    assert key == console.help_cache_key(["r3l", "fit", "--help"], [tmp_path], 100)
    assert key != console.help_cache_key(["r3l", "validate", "--help"], [tmp_path], 100)
    assert key != console.help_cache_key(["r3l", "fit", "--help"], [tmp_path], 80)
    (tmp_path / "a.py").write_text("x = 22\n")
    assert key != console.help_cache_key(["r3l", "fit", "--help"], [tmp_path], 100)


@pytest.mark.parametrize(
    "flag, value, instead",
    [("gradient_clip_val", "1.0", "model.optim.grad_clip"), ("accumulate_grad_batches", "4", "model.optim.micro_batch_size")],
)
def test_trainer_flags_that_do_nothing_here_are_refused_with_the_key_to_use(flag, value, instead, tmp_path, monkeypatch, capsys):
    from r3lightning.cli.main import main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(copy.deepcopy(TINY_CLI_RUN)))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["r3l", "fit", "--config", str(path), f"--trainer.{flag}", value])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 1
    error = capsys.readouterr().err
    assert error.startswith(f"r3l: error: trainer.{flag} (") and "does nothing in r3lightning" in error, error
    assert instead in error


def test_openmp_threads_sleep_when_idle_on_a_busy_machine_unless_the_user_chose_a_wait_policy():
    quiet, busy, chosen = {}, {}, {"OMP_WAIT_POLICY": "active"}
    # Quiet now, whatever the load average still remembers of a job that just ended.
    assert console.choose_wait_policy(quiet, running=0.0, load=1.9) is None and quiet == {}
    assert "busy (1 other threads running)" in console.choose_wait_policy(busy, running=1.0, load=0.0)
    assert busy == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert console.choose_wait_policy(chosen, running=3.0) is None and chosen == {"OMP_WAIT_POLICY": "active"}


def test_without_a_running_count_the_load_average_decides(monkeypatch):
    monkeypatch.setattr(console, "running_elsewhere", lambda: None)
    quiet, busy = {}, {}
    assert console.choose_wait_policy(quiet, load=0.2) is None and quiet == {}
    assert "busy (load average 1.3)" in console.choose_wait_policy(busy, load=1.3)
    assert busy == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_running_elsewhere_is_the_median_count_less_the_reader(tmp_path, monkeypatch):
    counts = iter([3, 1, 2, 9, 2])
    stat = tmp_path / "stat"

    def next_count(_seconds):
        stat.write_text(f"cpu  1 2 3\nprocs_running {next(counts)}\nprocs_blocked 0\n")

    next_count(0)
    monkeypatch.setattr(console.time, "sleep", next_count)
    assert console.running_elsewhere(samples=5, stat_path=str(stat)) == 1.0  # median of 2, 0, 1, 8, 1
    assert console.running_elsewhere(stat_path=str(tmp_path / "missing")) is None
    (tmp_path / "other").write_text("cpu  1 2 3\n")
    assert console.running_elsewhere(stat_path=str(tmp_path / "other")) is None


def test_a_command_that_runs_decides_the_wait_policy_before_lightning_loads(tmp_path):
    """``main`` decides before it hands the command to Lightning's CLI (whose import loads torch and its
    OpenMP runtime, which reads the policy once): busy here, as the running count is made to read."""
    code = (
        "import os, sys\n"
        "from r3lightning.cli import console\n"
        "console.running_elsewhere = lambda: 2.0\n"
        "seen = {}\n"
        "import r3lightning.cli.main as cli_main\n"
        "cli_main.main = lambda args=None: seen.update(policy=os.environ.get('OMP_WAIT_POLICY'))\n"
        "console.main(['fit', '--config', 'x.yaml'])\n"
        "print(seen['policy'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, "R3L_CACHE_DIR": str(tmp_path)}, timeout=300)
    assert out.stdout.split()[-1] == "PASSIVE", out.stderr[-2000:]
    assert "the machine is busy (2 other threads running)" in out.stderr
