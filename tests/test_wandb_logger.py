"""The W&B logger as a user meets it: an online logger that cannot start is one line naming the logger
and the offline switch, within seconds; an offline run's ``--ckpt_path last`` finds its checkpoint; its
run artefacts go to the run's own folder, not the working directory."""

import socket
import sys

import pytest
from test_own_task import page_files

pytest.importorskip("wandb")

WANDB = ["--trainer.logger.class_path", "lightning.pytorch.loggers.WandbLogger"]


def _fit(tmp_path, monkeypatch, *extra):
    from r3lightning.cli.main import main

    for name, text in page_files().items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_reward", raising=False)
    monkeypatch.setattr(sys, "argv", ["r3l", "fit", "--config", "own_task.yaml", "--trainer.limit_val_batches", "0", *WANDB, *extra])
    main()


def test_an_unreachable_wandb_service_is_one_line_with_the_offline_switch(tmp_path, monkeypatch, capsys):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: the connection is refused at once
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(SystemExit) as stop:
        _fit(tmp_path, monkeypatch, "--trainer.max_steps", "1")
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err
    assert f"r3l: error: trainer.logger (WandbLogger): cannot reach the W&B service at http://127.0.0.1:{port}" in err
    assert "set trainer.logger.init_args.offline: true (or WANDB_MODE=offline)" in err


def test_an_offline_wandb_run_resumes_with_ckpt_path_last_and_keeps_its_files_in_its_folder(tmp_path, monkeypatch, capsys):
    args = ["--trainer.logger.init_args.offline", "true", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")]
    _fit(tmp_path, monkeypatch, "--trainer.max_steps", "2", *args)
    [run] = list((tmp_path / "logs" / "lightning_logs").iterdir())
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "rollout_samples.jsonl").is_file() and not (tmp_path / "rollout_samples.jsonl").exists()
    capsys.readouterr()
    _fit(tmp_path, monkeypatch, "--trainer.max_steps", "3", "--ckpt_path", "last", *args)
    out = capsys.readouterr().out
    assert f"--ckpt_path last: {run / 'checkpoints' / 'last.ckpt'}" in out
