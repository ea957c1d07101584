"""A checkpoint's restorable state (task cursor, R³ replay buffer, module section, the distillation
phase's teacher, callback states: health history) is checked before Lightning restores any of it; a damaged field
ends ``r3l fit --ckpt_path`` with one line naming the checkpoint and the field (issue 38, item 3)."""

import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import yaml
from harness import TINY_CLI_RUN

from r3lightning.training.checkpoint_state import check_checkpoint_state
from r3lightning.cli.main import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step R³-replay run through ``r3l fit``: its recipe and ``last.ckpt``."""
    root = tmp_path_factory.mktemp("state")
    recipe = root / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY_CLI_RUN))
    with mock.patch.object(sys, "argv", ["r3l"]):
        main(["fit", "--config", str(recipe), f"--trainer.default_root_dir={root}", "--trainer.max_steps=2",
              "--data.replay.enabled=true"])
    last = root / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(last, weights_only=False)
    assert checkpoint["RolloutDataModule"]["replay_buffer"]["entries"], "the run must have stored trajectories"
    return SimpleNamespace(root=root, recipe=str(recipe), checkpoint=checkpoint)


def _delete(key):
    def damage(state):
        del state[key]
    return damage


DAMAGES = {
    "cursor-text": (lambda c: c["RolloutDataModule"].update(cursor="abc"), "RolloutDataModule.cursor: 'abc' is not a whole number"),
    "cursor-missing": (lambda c: _delete("cursor")(c["RolloutDataModule"]), "RolloutDataModule.cursor: missing"),
    "replay-version": (lambda c: c["RolloutDataModule"]["replay_buffer"].update(version=99),
                       "RolloutDataModule.replay_buffer.version: unknown state version 99"),
    "replay-trajectory": (lambda c: _delete("turns")(c["RolloutDataModule"]["replay_buffer"]["entries"][0]["trajectory"]),
                          "RolloutDataModule.replay_buffer.entries[0].trajectory: cannot be rebuilt (KeyError: 'turns')"),
    "replay-seq": (lambda c: c["RolloutDataModule"]["replay_buffer"]["entries"][1].update(seq="x"),
                   "RolloutDataModule.replay_buffer.entries[1].seq: 'x' is not a whole number"),
    "replay-visits": (lambda c: c["RolloutDataModule"]["replay_buffer"].update(visits=None),
                      "RolloutDataModule.replay_buffer.visits: a NoneType where a dict was expected"),
    "phase": (lambda c: c["r3lightning"].update(phase="warmup"), "r3lightning.phase: 'warmup' is not one of warmstart, rl"),
    "health-history": (lambda c: c["callbacks"]["HealthWatchdog"]["history"].update({"reward/mean": ["high"]}),
                       "callbacks['HealthWatchdog'].history['reward/mean']: 'high' is not a number"),
}


@pytest.mark.parametrize("case", list(DAMAGES))
def test_a_damaged_field_is_one_line_naming_the_checkpoint_and_the_field(run, tmp_path, capsys, case):
    damage, field = DAMAGES[case]
    checkpoint = {**run.checkpoint, "RolloutDataModule": _copy(run.checkpoint["RolloutDataModule"]),
                  "r3lightning": dict(run.checkpoint["r3lightning"]), "callbacks": _copy(run.checkpoint["callbacks"])}
    damage(checkpoint)
    damaged = tmp_path / "damaged.ckpt"
    torch.save(checkpoint, damaged)
    with mock.patch.object(sys, "argv", ["r3l"]), pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", run.recipe, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=3",
              "--data.replay.enabled=true", "--ckpt_path", str(damaged)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "Traceback" not in err
    assert f"r3l: error: checkpoint {str(damaged)!r}: damaged state, {field}" in err


def _copy(value):
    return torch.utils._pytree.tree_map(lambda x: x, value) if isinstance(value, (dict, list)) else value


def test_the_distillation_teacher_is_checked_before_it_is_restored():
    trainer = SimpleNamespace(callbacks=[], datamodule=None)
    state = {"phase": "distill", "beta": 0.05, "estimator": "exact", "switch_step": 4, "switched_at": 4,
             "teacher": {"lm_head.weight": "not a tensor"}, "teacher_path": None, "records": []}
    with pytest.raises(ValueError, match=r"checkpoint 'x.ckpt': damaged state, r3lightning\.distill"
                                         r".teacher\['lm_head.weight'\]: a str where a Tensor was expected"):
        check_checkpoint_state({"r3lightning": {"distill": state}}, "x.ckpt", trainer)
    # A checkpoint of the old ReflectiveToDirectDistillation callback keeps the same state among the callbacks'.
    with pytest.raises(ValueError, match=r"damaged state, callbacks\['ReflectiveToDirectDistillation'\]"
                                         r".teacher\['lm_head.weight'\]: a str where a Tensor was expected"):
        check_checkpoint_state({"callbacks": {"ReflectiveToDirectDistillation": state}}, "x.ckpt", trainer)
    state["teacher"] = {"lm_head.weight": torch.zeros(2)}
    check_checkpoint_state({"r3lightning": {"distill": state}}, "x.ckpt", trainer)
    check_checkpoint_state({"callbacks": {"ReflectiveToDirectDistillation": state}}, "x.ckpt", trainer)
