"""The module uses the datamodule through ``connect``, ``rollout`` (RL steps), ``demonstrations``
(warm-start steps) and ``evaluate`` (and, to train an in-memory tokenizer, ``tokenizer_corpus``; to size
the engine, ``context_budget``); everything else a step needs comes with the rollout."""

import ast
from pathlib import Path

MODULE = Path(__file__).resolve().parents[2] / "r3lightning" / "module.py"


def datamodule_uses() -> set[str]:
    """Attributes the module reads of ``self.datamodule`` or of a local name bound to it."""
    tree = ast.parse(MODULE.read_text())
    aliases = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == "self.datamodule"
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and (ast.unparse(node.value) == "self.datamodule" or ast.unparse(node.value) in aliases)
    }


def test_the_module_uses_the_datamodule_through_connect_rollout_demonstrations_and_evaluate():
    assert datamodule_uses() == {"connect", "rollout", "demonstrations", "evaluate", "tokenizer_corpus", "context_budget"}
