"""Checkpoints lose no work (docs/reliability.md): ``last.ckpt`` after every save and at the end of fit
with or without validation, atomic files, ``--ckpt_path last``, and a run killed with SIGTERM in the
middle of a step that resumes to the parameters of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import BASE_RECIPE, ROOT, module_and_data, parse_only_cli, quiet_trainer

from r3lightning.callbacks.checkpointing import StepCheckpoint
from r3lightning.checkpointing.io import AtomicCheckpointIO, atomic_torch_save, atomic_write
from r3lightning.cli.main import R3LightningCLI, resolve_last_ckpt_path


def saved_step(path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["global_step"]


def fit(tmp_path, steps, checkpoint, **trainer_args):
    module, dm = module_and_data(micro_batch_size=4)
    trainer = quiet_trainer(
        steps, enable_checkpointing=True, default_root_dir=str(tmp_path), callbacks=[checkpoint],
        plugins=[AtomicCheckpointIO()], **trainer_args,
    )
    trainer.fit(module, dm)
    return trainer


# ---- when ---------------------------------------------------------------------------------------------
def test_last_ckpt_without_validation_every_n_steps_and_at_the_end(tmp_path):
    fit(tmp_path, 7, StepCheckpoint(every_n_steps=3, keep=2))
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt", "step=6.ckpt", "step=7.ckpt"]  # step 3 rotated out
    assert saved_step(directory / "last.ckpt") == 7
    assert os.path.samefile(directory / "last.ckpt", directory / "step=7.ckpt")  # a link, not a second copy
    assert saved_step(directory / "step=6.ckpt") == 6


def test_no_step_lost_with_validation_every_5_of_14(tmp_path):
    """``max_steps: 14, val_check_interval: 5``: Lightning's own checkpoint saved step 10 only."""
    fit(tmp_path, 14, StepCheckpoint(), limit_val_batches=1, val_check_interval=5, check_val_every_n_epoch=None)
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt", "step=14.ckpt"]
    assert saved_step(directory / "last.ckpt") == 14


# ---- atomic files -------------------------------------------------------------------------------------
def test_a_failed_write_leaves_the_old_file_and_no_partial_one(tmp_path):
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1}, str(target))

    def half_then_fail(handle):
        handle.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(str(target), half_then_fail)
    with pytest.raises(Exception):  # a lambda does not pickle: torch.save fails half-way
        AtomicCheckpointIO().save_checkpoint({"step": 2, "fn": lambda: 0}, str(target))
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no temporary file left behind
    assert torch.load(target, weights_only=True) == {"step": 1}

    AtomicCheckpointIO().save_checkpoint({"step": 3}, str(tmp_path / "sub" / "x.ckpt"))
    assert torch.load(tmp_path / "sub" / "x.ckpt", weights_only=True) == {"step": 3}
    assert os.listdir(tmp_path / "sub") == ["x.ckpt"]


# ---- --ckpt_path last ---------------------------------------------------------------------------------
def parsed(tmp_path, *extra):
    return parse_only_cli().parser.parse_args(
        ["fit", "--config", str(BASE_RECIPE), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *extra]
    )


def test_ckpt_path_last_is_the_newest_last_ckpt_of_any_version(tmp_path, capsys):
    for version, age in (("version_0", 100), ("version_2", 10), ("version_1", 50)):
        path = tmp_path / "runs" / "r3l" / version / "checkpoints" / "last.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        os.utime(path, (time.time() - age, time.time() - age))
    config = parsed(tmp_path, "--ckpt_path", "last")
    resolve_last_ckpt_path(config)
    assert config.fit.ckpt_path == str(tmp_path / "runs" / "r3l" / "version_2" / "checkpoints" / "last.ckpt")
    assert "--ckpt_path last: " in capsys.readouterr().out

    given = parsed(tmp_path, "--ckpt_path", "some.ckpt")
    resolve_last_ckpt_path(given)
    assert given.fit.ckpt_path == "some.ckpt"


def test_ckpt_path_last_without_a_checkpoint_fails_naming_where_it_looked(tmp_path):
    config = parsed(tmp_path, "--ckpt_path", "last")
    with pytest.raises(ValueError, match=r"--ckpt_path last: no last.ckpt found \(looked in .*runs/r3l/\*/checkpoints\)"):
        resolve_last_ckpt_path(config)


# ---- SIGTERM in the middle of a step ------------------------------------------------------------------
TINY_FIT = [
    "--config", str(BASE_RECIPE),
    "--model.phases.warmstart.steps", "2",
    "--data.tasks_per_step", "2", "--data.group_size", "4", "--model.phases.warmstart.demos.tasks_per_step", "4",
    "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
]


def cli_fit(tmp_path, steps, *extra):
    args = ["fit", *TINY_FIT, "--trainer.max_steps", str(steps), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *extra]
    cli = R3LightningCLI(args=args)
    return {k: v.detach().clone() for k, v in cli.model.policy.state_dict().items()}, cli


def test_sigterm_mid_step_saves_the_step_boundary_and_resumes_to_the_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["r3l"])
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable, "-m", "r3lightning.cli.main", "fit", *TINY_FIT, "--trainer.max_steps", "6",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"),
        "--trainer.callbacks+=signal_helpers.PauseMidStep", f"--trainer.callbacks.ready_file={ready}",
    ]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), process.communicate(timeout=30)[0] if process.poll() is not None else "not ready in time"
        process.send_signal(signal.SIGTERM)  # step 3 is running: rolled out and backpropagated, not yet applied
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    last = tmp_path / "runs" / "r3l" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"stopped by SIGTERM after global step 3 (a step boundary); saved {last}" in output, output
    assert "--ckpt_path last" in output
    assert saved_step(last) == 3  # the running step was finished, then saved
    assert not list(last.parent.glob(".*.tmp")) and not (last.parent / "exception.ckpt").exists()

    resumed, cli = cli_fit(tmp_path, 6, "--ckpt_path", "last")
    assert cli.trainer.global_step == 6 and cli.datamodule.cursor == 6
    straight, _ = cli_fit(tmp_path / "straight", 6)
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-6, atol=1e-7, msg=name)


def two_signals_in_a_rollout(tmp_path, signum, *extra, hold="HoldInRollout"):
    """An ``r3l fit`` subprocess held inside a decoding step of step 3's rollout (``HoldInRollout``; or
    in its update: ``HoldMidStep``) receives ``signum`` twice. Returns the exit status, the output, the
    checkpoint folder and how many forwards (decoding steps, training micro-batches) the run still made
    after the second signal."""
    ready, seen, after = tmp_path / "ready", tmp_path / "seen", tmp_path / "after"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable, "-m", "r3lightning.cli.main", "fit", *TINY_FIT, "--trainer.max_steps", "6",
        "--data.sampling.max_new_tokens", "24", "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *extra,
        f"--trainer.callbacks+=signal_helpers.{hold}", f"--trainer.callbacks.ready_file={ready}", f"--trainer.callbacks.seen_file={seen}",
        *([f"--trainer.callbacks.after_file={after}"] if hold == "HoldInRollout" else []),
    ]
    # A suite started in the background (``cmd &``, nohup) hands its children SIGINT ignored: give the
    # run the default, as a terminal does.
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for flag in (ready, seen):
            # Generous: a loaded 2-core machine takes over a minute to start the subprocess's Lightning.
            deadline = time.monotonic() + 600
            while not flag.exists() and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert flag.exists(), process.communicate(timeout=30)[0] if process.poll() is not None else f"no {flag.name} in time"
            process.send_signal(signum)
        output, _ = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
    forwards_after = len(after.read_text().split()) if after.exists() else 0
    return process.returncode, output, tmp_path / "runs" / "r3l" / "version_0" / "checkpoints", forwards_after


def test_a_second_sigterm_stops_inside_the_rollout_and_writes_the_one_checkpoint_it_names(tmp_path, monkeypatch):
    """SIGTERM twice inside a decoding step of step 3, no checkpoint saved yet: the run stops before
    another decoding step (not after the rest of the rollout and the update), exits 143, and writes one
    file, exception.ckpt with step 2's weights, which the second signal's line names."""
    monkeypatch.setattr(sys, "argv", ["r3l"])
    returncode, output, checkpoints, forwards_after = two_signals_in_a_rollout(tmp_path, signal.SIGTERM)
    exception = checkpoints / "exception.ckpt"
    assert returncode == 128 + signal.SIGTERM, output
    assert forwards_after == 0, output  # the step's 23 other decoding steps and its update never ran
    assert f"SIGTERM again: stopping now, inside global step 3 (dropped); saving {exception} with the weights of global step 2" in output, output
    assert sorted(p.name for p in checkpoints.iterdir()) == ["exception.ckpt"], output
    assert saved_step(exception) == 2


def test_a_second_ctrl_c_exits_130_naming_the_checkpoint_that_exists_and_writes_no_copy(tmp_path, monkeypatch):
    """Ctrl-C twice inside step 3's rollout after last.ckpt was saved at step 2: the second stops at once;
    the run exits 130 (not Lightning's 1), names that last.ckpt and writes no exception.ckpt beside it
    (the same weights twice: 1.6 GB more for a 135M model)."""
    monkeypatch.setattr(sys, "argv", ["r3l"])
    returncode, output, checkpoints, forwards_after = two_signals_in_a_rollout(
        tmp_path, signal.SIGINT, "--trainer.callbacks+=r3lightning.callbacks.StepCheckpoint", "--trainer.callbacks.every_n_steps=2",
    )
    last = checkpoints / "last.ckpt"
    assert returncode == 128 + signal.SIGINT, output
    assert forwards_after == 0, output
    assert f"SIGINT again: stopping now, inside global step 3 (dropped); writing nothing more: {last} holds global step 2" in output, output
    assert f"--ckpt_path {last}" in output
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step=2.ckpt"], output
    assert saved_step(last) == 2


def test_a_second_sigterm_during_the_update_lets_the_step_end_and_saves_it_once(tmp_path, monkeypatch):
    """SIGTERM twice while step 3 applies its update (inside the optimizer step): the update is not cut
    (half-applied, it would damage the weights); the step ends, last.ckpt holds step 3, the line says so,
    and no exception.ckpt copies it."""
    monkeypatch.setattr(sys, "argv", ["r3l"])
    returncode, output, checkpoints, _ = two_signals_in_a_rollout(tmp_path, signal.SIGTERM, hold="HoldMidStep")
    last = checkpoints / "last.ckpt"
    assert returncode == 128 + signal.SIGTERM, output
    assert f"SIGTERM again: the step that is running has begun its update, which is not cut (it would damage the weights); stopping as soon as that step ends, saving {last}" in output, output
    assert f"stopped by SIGTERM after global step 3 (a step boundary); saved {last}" in output, output
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt", "step=3.ckpt"], output
    assert saved_step(last) == 3


def test_partial_files_of_saves_that_never_finished_are_removed_at_the_next_start(tmp_path, capsys):
    """A SIGKILL during a save leaves ``.last.ckpt.<pid>.<tag>.tmp``; the next run removes it, and keeps
    the temporary file of a process that is still running."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    stale = directory / ".last.ckpt.4194999.0123abcd.tmp"  # above Linux's largest process id: no such process
    live = directory / f".last.ckpt.{os.getppid()}.0123abcd.tmp"
    stale.write_bytes(b"half a checkpoint")
    live.write_bytes(b"being written")
    fit(tmp_path, 2, StepCheckpoint(every_n_steps=0))
    assert not stale.exists() and live.exists()
    assert f"removed 1 partial checkpoint file(s) of saves that never finished: {stale}" in capsys.readouterr().out
