"""experiments/suite_survey.py without the model: the validate configs it writes, the figures it reads
from a run's scalars, and its table."""

import importlib
from pathlib import Path

import pytest

from experiments.suite_survey import figures_from_scalars, markdown_table, missing_package, suite_config


def _suite(config: dict):
    spec = config["data"]["suite"]
    module, name = spec["class_path"].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**spec["init_args"])


@pytest.mark.parametrize("name", ["add20_number", "add20_boxed", "addsub9_3terms_number", "world_d1"])
def test_a_suite_config_builds_its_suite_with_the_tasks_asked_in_one_batch(name):
    config = suite_config(name, 48, "/tmp/logs")
    assert len(_suite(config).val_tasks()) == 48 == config["data"]["val_tasks_per_batch"]
    assert config["model"]["model"]["gguf_file"].endswith(".gguf")
    assert config["trainer"]["logger"]["init_args"] == {"save_dir": "/tmp/logs", "name": name, "version": "survey"}


def test_the_number_only_addition_is_the_quickstarts_validation_set():
    import yaml

    quickstart = yaml.safe_load((Path(__file__).parents[1] / "configs/quickstart.yaml").read_text())["data"]["suite"]
    ours = suite_config("add20_number", 64, "/tmp/logs")["data"]["suite"]
    from r3lightning.envs.math_env import MathSuite

    theirs = MathSuite(**quickstart["init_args"]).val_tasks()
    assert [t.prompt for t in _suite({"data": {"suite": ours}}).val_tasks()] == [t.prompt for t in theirs]


def test_figures_come_from_the_last_validation_and_mark_the_band():
    scalars = {
        "val/success_rate_greedy": [(0, 0.34375)],
        "val/success_rate": [(0, 0.0625)],
        "val/response_len_greedy": [(0, 17.5)],
        "val/response_len": [(0, 18.25)],
        "val/truncated_rate_greedy": [(0, 0.25)],
        "val/truncated_rate": [(0, 0.5)],
    }
    figures = figures_from_scalars(scalars, 64)
    assert figures["greedy_solved"] == 22 and figures["sampled_solved"] == 4
    assert figures["greedy_in_band"] and not figures["sampled_in_band"]
    assert figures["response_tokens_sampled"] == 18.25
    with pytest.raises(ValueError, match="no validation scalars"):
        figures_from_scalars({"train/loss": [(0, 1.0)]}, 64)
    table = markdown_table({
        "add20_number": {**figures, "about": "a+b", "cpu_s": 45.0, "wall_s": 800.0},
        "champ_boxed": {"about": "CHAMP", "skipped": "the champ_dataset package is not installed"},
    })
    assert "| 34.4% ✓ | 6.2% | 64 | 17.5, 18.2 | 45 s | 800 s |" in table
    assert "skipped: the champ_dataset package is not installed" in table


def test_a_suite_whose_package_is_missing_says_so(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert missing_package("rg_chain_sum_number") == "the reasoning_gym package is not installed in this environment"
    assert missing_package("add20_number") is None
