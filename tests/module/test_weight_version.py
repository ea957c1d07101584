"""``engine.weight_version`` has one writer, ``R3LightningModule.stamp_weight_version``: the step (an
engine sharing the policy's weights), the vLLM sync and a checkpoint restore all go through it."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def weight_version_writes() -> list[str]:
    """Every assignment to an attribute ``weight_version`` in the package and its callbacks, as
    ``file:function``, except an engine constructor's ``self.weight_version = 0``."""
    found = []
    for path in sorted([*(ROOT / "r3lightning").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(function):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr == "weight_version":
                        initial = function.name == "__init__" and isinstance(node, ast.Assign) and ast.unparse(node) == "self.weight_version = 0"
                        if not initial:
                            found.append(f"{path.relative_to(ROOT)}:{function.name}")
    return found


def test_the_module_is_the_one_writer_of_the_engine_weight_version():
    assert weight_version_writes() == ["r3lightning/module.py:stamp_weight_version"]
