"""Resume that respects the user (docs/reliability.md, "Resume and evaluation"): ``r3l fit --ckpt_path``
with a config that differs from the checkpoint's on a key that defines the run fails before training,
in one line naming every differing key with both values; ``--resume_with checkpoint`` takes the
checkpoint's values, ``--resume_with config`` keeps the config's method (never another shape); tuning
keys take the config's values, said in a note. ``r3l validate`` refuses a random tiny model without a
checkpoint. Run through ``r3lightning.cli.main`` in-process, on a checkpoint written by ``r3l fit``."""

import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml
from harness import CONFIGS, TINY_CLI_RUN, TINY_SPEC

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.cli.main import main
from r3lightning.checkpointing.resume import check_resume, resume_differences
from r3lightning.training.models import ModelConfig

def r3l(root: Path, capsys, *args):
    """(exit status, stdout, stderr) of ``r3l <args>`` run in-process, writing under ``root``."""
    code = 0
    with mock.patch.object(sys, "argv", ["r3l"]):
        try:
            main([*args[:1], f"--trainer.default_root_dir={root}", *args[1:]])
        except SystemExit as stop:
            code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_CLI_RUN))
    return str(path)


@pytest.fixture(scope="module")
def grpo_checkpoint(recipe, tmp_path_factory):
    """A GRPO checkpoint of the tiny recipe after one step, written by ``r3l fit``."""
    root = tmp_path_factory.mktemp("grpo")
    with mock.patch.object(sys, "argv", ["r3l"]):
        main(["fit", "--config", recipe, f"--trainer.default_root_dir={root}"])
    checkpoints = sorted(root.rglob("*.ckpt"))
    assert checkpoints, "r3l fit wrote no checkpoint"
    return str(checkpoints[0])


def saved_config(root: Path) -> dict:
    return yaml.safe_load((root / "config.yaml").read_text())


def test_another_algorithm_preset_is_refused_before_training_naming_every_key(recipe, grpo_checkpoint, tmp_path, capsys):
    code, _, err = r3l(tmp_path, capsys, "fit", "--config", recipe, "--config", str(CONFIGS / "algorithms" / "rloo.yaml"),
                       "--trainer.max_steps=2", "--ckpt_path", grpo_checkpoint)
    assert code == 1
    line = err.strip().splitlines()[-2]
    assert line.startswith(f"r3l: error: --ckpt_path {grpo_checkpoint!r}: the config differs from the checkpoint on keys that define the method")
    for key, old, new in [("advantage", "grpo", "rloo"), ("policy_loss", "ppo_clip", "pg"), ("aggregation", "token_mean", "seq_mean_token_sum")]:
        assert f"model.algorithm.{key} (checkpoint: {old!r}, config: {new!r})" in line
    assert "--resume_with checkpoint" in line and "Traceback" not in err
    assert not list(tmp_path.rglob("*.ckpt")) and not (tmp_path / "config.yaml").exists()  # nothing was built


def test_another_model_shape_is_refused_even_with_resume_with_config(recipe, grpo_checkpoint, tmp_path, capsys):
    wider = ["--model.model.tiny.hidden_size=128", "--model.model.tiny.num_attention_heads=4"]
    for extra in ([], ["--resume_with", "config"]):
        code, _, err = r3l(tmp_path, capsys, "fit", "--config", recipe, *wider, "--trainer.max_steps=2",
                           "--ckpt_path", grpo_checkpoint, *extra)
        assert code == 1
        assert "differs from the checkpoint on the model's shape or source" in err
        assert "model.model.tiny.hidden_size (checkpoint: 64, config: 128)" in err
        assert "model.model.tiny.num_attention_heads (checkpoint: 2, config: 4)" in err
    assert "its weights cannot take this shape" in err
    assert not list(tmp_path.rglob("*.ckpt"))


def test_resume_with_checkpoint_takes_the_checkpoint_values(recipe, grpo_checkpoint, tmp_path, capsys):
    code, out, err = r3l(tmp_path, capsys, "fit", "--config", recipe, "--config", str(CONFIGS / "algorithms" / "rloo.yaml"),
                         "--trainer.max_steps=2", "--ckpt_path", grpo_checkpoint, "--resume_with", "checkpoint")
    assert code == 0, err
    assert "[r3lightning] resume: the checkpoint's values replace the config's for model.algorithm.advantage (checkpoint: 'grpo', config: 'rloo')" in out
    algorithm = saved_config(tmp_path)["model"]["algorithm"]
    assert (algorithm["advantage"], algorithm["policy_loss"]) == ("grpo", "ppo_clip")


def test_resume_with_config_keeps_the_config_method_and_tuning_keys_take_the_config_values(recipe, grpo_checkpoint, tmp_path, capsys):
    code, out, err = r3l(tmp_path, capsys, "fit", "--config", recipe, "--config", str(CONFIGS / "algorithms" / "rloo.yaml"),
                         "--model.optim.lr=5e-4", "--trainer.max_steps=2", "--ckpt_path", grpo_checkpoint, "--resume_with", "config")
    assert code == 0, err
    assert "[r3lightning] resume: the config's values replace the checkpoint's for model.algorithm.advantage (checkpoint: 'grpo', config: 'rloo')" in out
    assert "model.optim.lr (checkpoint: 0.001, config: 0.0005)" in out
    config = saved_config(tmp_path)["model"]
    assert (config["algorithm"]["advantage"], config["optim"]["lr"]) == ("rloo", 5e-4)


def test_resume_with_a_new_learning_rate_needs_no_flag_and_is_said(recipe, grpo_checkpoint, tmp_path, capsys):
    code, out, err = r3l(tmp_path, capsys, "fit", "--config", recipe, "--model.optim.lr=5e-4", "--trainer.max_steps=2",
                         "--ckpt_path", grpo_checkpoint)
    assert code == 0, err
    assert "[r3lightning] resume: the config's values replace the checkpoint's for model.optim.lr (checkpoint: 0.001, config: 0.0005)" in out
    assert saved_config(tmp_path)["model"]["optim"]["lr"] == 5e-4


def test_differences_are_classified_and_python_checkpoints_compare_too():
    saved = {"model": ModelConfig(tiny=TINY_SPEC), "algorithm": AlgorithmConfig(advantage="grpo"), "max_bad_steps": 5}
    parsed = {"model": ModelConfig(tiny=TINY_SPEC, dtype="bfloat16", lora_alpha=8),
              "algorithm": AlgorithmConfig(advantage="rloo", adv_eps=1e-3), "max_bad_steps": 2}
    diff = resume_differences(saved, parsed)
    assert [k for k, _, _ in diff["method"]] == ["model.model.dtype", "model.algorithm.advantage"]
    assert [k for k, _, _ in diff["tuning"]] == ["model.algorithm.adv_eps", "model.max_bad_steps"]
    assert diff["shape"] == []  # lora_alpha without LoRA changes nothing
    # A pretrained model's tiny spec is unused: no difference.
    pretrained = lambda **tiny: {"model": ModelConfig(name_or_path="/m", tiny=TINY_SPEC.__class__(**tiny))}  # noqa: E731
    assert resume_differences(pretrained(hidden_size=64), pretrained(hidden_size=128)) == {"shape": [], "method": [], "tuning": []}
    with pytest.raises(ValueError, match=r"model.model.name_or_path \(checkpoint: '/m', config: '/other'\)"):
        check_resume("x.ckpt", pretrained(), {"model": ModelConfig(name_or_path="/other")}, resume_with="config")
    assert check_resume("x.ckpt", saved, saved, resume_with=None) == (False, "")


def test_validate_without_a_checkpoint_is_refused_for_a_random_tiny_model(recipe, grpo_checkpoint, tmp_path, capsys):
    code, _, err = r3l(tmp_path, capsys, "validate", "--config", recipe)
    assert code == 1
    assert "r3l: error: r3l validate: no --ckpt_path, and the model is a tiny model built at random" in err
    code, _, err = r3l(tmp_path, capsys, "validate", "--config", recipe, "--ckpt_path", grpo_checkpoint)
    assert code == 0, err


def test_validate_a_pretrained_model_directory_without_a_checkpoint(recipe, grpo_checkpoint, tmp_path, capsys):
    from r3lightning.checkpointing.export import export_checkpoint

    model_dir = export_checkpoint(grpo_checkpoint, str(tmp_path / "model"))
    code, _, err = r3l(tmp_path, capsys, "validate", "--config", recipe, f"--model.model.name_or_path={model_dir}")
    assert code == 0, err
