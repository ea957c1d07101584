"""docs/own_task.md as a user follows it: the page's JSONL, reward file and config written to a fresh
directory, ``r3l fit`` for 3 steps there (a tiny model from the config), and the reward function's
values are what the run logs as ``reward/mean``."""

import csv
import importlib
import re
import sys

import pytest
from harness import ROOT

PAGE = ROOT / "docs" / "own_task.md"
FILE_BLOCK = re.compile(r'```\w+ title="([^"]+)"\n(.*?)```', re.DOTALL)


def page_files() -> dict[str, str]:
    return {name: text for name, text in FILE_BLOCK.findall(PAGE.read_text())}


def test_the_page_gives_the_three_files_and_a_ten_line_reward():
    files = page_files()
    assert set(files) == {"tasks.jsonl", "my_reward.py", "own_task.yaml"}
    assert len(files["my_reward.py"].strip().splitlines()) <= 10
    assert "r3l fit --config own_task.yaml" in PAGE.read_text()


def test_own_task_example_trains_and_logs_the_reward_function_values(tmp_path, monkeypatch):
    from r3lightning.cli.main import main

    for name, text in page_files().items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # r3l puts the working directory on it
    monkeypatch.delitem(sys.modules, "my_reward", raising=False)
    # Record every value the user's function returns: the suite imports ``my_reward`` by name and gets
    # this module, whose ``reward`` is wrapped.
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_reward")
    returned, user_reward = [], module.reward

    def recording(**kwargs):
        assert set(kwargs) == {"completion", "prompt", "answer", "level"}
        returned.append(user_reward(**kwargs))
        return returned[-1]

    monkeypatch.setattr(module, "reward", recording)
    steps, per_step = 3, 4 * 2  # group_size x tasks_per_step answers a step
    monkeypatch.setattr(sys, "argv", ["r3l", "fit", "--config", "own_task.yaml", "--trainer.max_steps", str(steps)])
    main()
    with open(tmp_path / "runs" / "own_task" / "version_0" / "metrics.csv") as handle:
        logged = [float(row["reward/mean"]) for row in csv.DictReader(handle) if row.get("reward/mean")]
    assert len(logged) == steps
    returned = returned[1:]  # the first call is set-up's check of the function on the file's first row
    expected = [sum(returned[i * per_step:(i + 1) * per_step]) / per_step for i in range(steps)]
    assert logged == pytest.approx(expected)
    assert set(returned) <= {0.0, 0.1, 0.2, 1.0}
    sys.modules.pop("my_reward", None)


def test_r3l_makes_the_working_directory_importable_as_python_m_does(tmp_path, monkeypatch):
    from r3lightning.cli.main import importable_working_directory

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    importable_working_directory()
    assert sys.path[0] == str(tmp_path)


BROKEN_REWARDS = {
    "raises": "def reward(completion, **row):\n    raise RuntimeError('reward server returned HTTP 500')\n",
    "sleeps": "import time\ndef reward(completion, **row):\n    time.sleep(3600)\n",
}


@pytest.mark.parametrize("kind, expected", [
    ("raises", "raised RuntimeError: reward server returned HTTP 500 on row"),
    ("sleeps", "CallTimeout"),
])
def test_a_reward_function_that_fails_on_every_call_stops_the_run_in_its_first_step(tmp_path, monkeypatch, capsys, kind, expected):
    """Not exit 0 with nothing trained: exit 1 at the end of the first RL step, naming the function
    (``module:function``), the row and the exception."""
    from r3lightning.cli.main import main

    for name, text in page_files().items():
        (tmp_path / name).write_text(text)
    module_name = f"broken_reward_{kind}"
    (tmp_path / f"{module_name}.py").write_text(BROKEN_REWARDS[kind])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr("r3lightning.envs.prompt_suite.PROBE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(sys, "argv", [
        "r3l", "fit", "--config", "own_task.yaml", "--trainer.max_steps", "5", "--trainer.limit_val_batches", "0",
        "--data.suite.init_args.reward_fn", f"{module_name}:reward", "--data.agent.step_timeout_s", "0.5",
    ])
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 1
    error = capsys.readouterr().err
    assert f"reward_fn '{module_name}:reward'" in error and expected in error
    assert "no reward could be computed for any of the 8 samples of training step 1" in error
    assert "r3l: error:" in error and len(error.strip().splitlines()) == 2  # the message and where it was raised
    sys.modules.pop(module_name, None)
