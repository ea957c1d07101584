"""Class paths moved by the package split are refused with the new path (as moved keys are), from the
command line and from a config file (named with its line); the table refuses nothing that exists."""

import importlib
import importlib.util

import pytest
from harness import BASE_RECIPE

from r3lightning.cli.main import main
from r3lightning.cli.moved_names import MOVED_MODULES, moved_class_path


@pytest.mark.parametrize("flag, old, new", [
    ("--data.explorer.class_path", "r3lightning.rollout.reflect_retry.ReflectRetryExplorer",
     "r3lightning.rollout.explorers.reflect_retry.ReflectRetryExplorer"),
    ("--trainer.plugins", "r3lightning.checkpoint_io.AtomicCheckpointIO", "r3lightning.checkpointing.io.AtomicCheckpointIO"),
])
def test_a_moved_class_path_on_the_command_line_is_refused_with_the_new_one(capsys, flag, old, new):
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(BASE_RECIPE), flag, old])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err.strip() == f"r3l: error: the command line: {old} moved to {new} (the package was split into layers, docs/design.md); use the new path"


def test_a_moved_class_path_in_a_config_file_names_the_file_and_line(tmp_path, capsys):
    config = tmp_path / "old.yaml"
    config.write_text("data:\n  explorer:\n    class_path: r3lightning.rollout.in_context.InContextExplorer\n")
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(BASE_RECIPE), "--config", str(config)])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert f"config file {str(config)!r}, line 3: r3lightning.rollout.in_context.InContextExplorer moved to " \
           "r3lightning.rollout.explorers.in_context.InContextExplorer" in err


@pytest.mark.parametrize("old, new", sorted(MOVED_MODULES.items()))
def test_every_old_module_is_gone_and_its_new_one_imports(old, new):
    assert importlib.util.find_spec(old) is None
    importlib.import_module(new)
    assert moved_class_path(f"{old}.Thing") == f"{new}.Thing" and moved_class_path(f"{new}.Thing") is None
