"""The module uses the datamodule through ``connect``, ``rollout`` (RL steps), ``demonstrations``
(warm-start steps) and ``evaluate`` (and, to train an in-memory tokenizer, ``tokenizer_corpus``; to size
the engine, ``context_budget``; for ReflectRL's distillation phase, which the module drives from
``training/distillation.py``, ``validation_tasks`` and ``teacher_contexts``); everything else a step
needs comes with the rollout."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "r3lightning"
USERS = {PACKAGE / "module.py": "self", PACKAGE / "training" / "distillation.py": "module"}
"""The files that use the datamodule, and the name the module has in them."""


def datamodule_uses() -> set[str]:
    """Attributes the module (and its distillation phase) read of the datamodule or of a local name bound to it."""
    used = set()
    for path, owner in USERS.items():
        tree = ast.parse(path.read_text())
        datamodule = f"{owner}.datamodule"
        aliases = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and ast.unparse(node.value) == datamodule
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        used |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and (ast.unparse(node.value) == datamodule or ast.unparse(node.value) in aliases)
        }
    return used


def test_the_module_uses_the_datamodule_through_connect_rollout_demonstrations_and_evaluate():
    assert datamodule_uses() == {"connect", "rollout", "demonstrations", "evaluate", "tokenizer_corpus", "context_budget",
                                 "validation_tasks", "teacher_contexts"}
