"""What ``r3l`` prints: a short ``fit`` of the CPU example prints what a user can act on (no
LightningCLI warning about ``args``, no dependency deprecation notices, no advertising tips), a
progress bar of steps, and a summary that says where the validation files and the progress plot are;
a bad input is one ``r3l: error:`` line and a hint. The fit runs as a user runs it: the ``r3l``
script in a subprocess."""

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from harness import BASE_RECIPE

SHORT_FIT = [
    "--config", str(BASE_RECIPE),
    "--trainer.max_steps", "2",
    "--model.phases.warmstart.steps", "1",
    "--trainer.val_check_interval", "2",
    "--data.val_tasks_per_batch", "8",
    "--data.suite.init_args.num_val_tasks", "8",
]


def r3l(args, cwd, timeout=300):
    script = Path(sys.executable).with_name("r3l")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "r3lightning.cli.main"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_short_fit_prints_only_what_a_user_can_act_on(tmp_path):
    done = r3l(["fit", *SHORT_FIT, "--data.val_samples", "2"], cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for noise in ("Tip", "litlogger", "litmodels", "DeprecationWarning", "FutureWarning", "is deprecated",
                  "args parameter is intended", "Epoch 0/-2"):
        assert noise not in output, f"{noise!r} in:\n{output}"
    assert "2/2" in output  # the progress bar counts steps up to max_steps
    log_dir = tmp_path / "runs" / "r3l" / "version_0"
    for name in ("validation_step2.json", "validation_step2.md", "phase_report.json", "progress.png"):
        assert (log_dir / name).is_file(), name
    summary = output[output.index("[r3lightning] validation success rate"):]
    assert "last validation: runs/r3l/version_0/validation_step2.json (and .md)" in summary
    assert "progress plot: runs/r3l/version_0/progress.png" in summary
    report = json.loads((log_dir / "validation_step2.json").read_text())
    assert (report["suite"], report["tasks"], report["samples_per_task"]) == ("MathSuite", 8, 2)
    assert {"val/pass@1", "val/pass@2", "val/mean@2", "val/truncated_rate"} <= set(report["metrics"])


def test_bad_input_is_one_error_line_and_a_hint(tmp_path, monkeypatch, capsys):
    # In this process, through ``main`` as the script calls it: a fresh interpreter would spend ~5 s on
    # imports, and what a fresh one prints besides the CLI's own lines is the short fit's check above.
    from r3lightning.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["r3l", "fit", "--config", "missing.yaml"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("r3l: error: Parser key \"config\": File does not exist:") and "missing.yaml" in lines[0]
    assert lines[1] == "  (r3l fit --help lists the accepted keys)"


def test_quiet_lightning_filters_only_the_listed_notices(caplog):
    from r3lightning.cli.main import quiet_lightning

    notices = [
        (FutureWarning, "lightning.pytorch.utilities._pytree", "`isinstance(treespec, LeafSpec)` is deprecated, use ..."),
        (UserWarning, "lightning.pytorch.loops.fit_loop", "Found 33 module(s) in eval mode at the start of training."),
        (UserWarning, "lightning.pytorch.loops.fit_loop", "Something else about the fit loop"),
        (FutureWarning, "somebody.elses.module", "`isinstance(treespec, LeafSpec)` is deprecated, use ..."),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()
        for category, module, text in notices:
            warnings.warn_explicit(text, category, "somewhere.py", 1, module=module)
    assert [(w.category, str(w.message)) for w in caught] == [(c, t) for c, _, t in notices[2:]]

    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        logger.info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]...")
        logger.info("GPU available: False, used: False")
    assert caplog.messages == ["GPU available: False, used: False"]
