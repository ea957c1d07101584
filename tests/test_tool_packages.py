"""``benchmarks``, ``experiments`` and ``scripts`` are packages run with ``python -m`` from the repository
root: every module imports as ``<package>.<module>`` and none edits ``sys.path``."""

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    f"{path.parent.name}.{path.stem}"
    for package in ("benchmarks", "experiments", "scripts")
    for path in (ROOT / package).glob("*.py")
    if path.stem != "__init__"
)


def test_every_tool_package_has_modules():
    assert {name.split(".")[0] for name in MODULES} == {"benchmarks", "experiments", "scripts"}


@pytest.mark.parametrize("name", MODULES)
def test_tool_module_imports_as_a_package_member_and_leaves_sys_path_alone(name):
    path = ROOT / f"{name.replace('.', '/')}.py"
    edits = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "path"
        and isinstance(node.value, ast.Name) and node.value.id == "sys"
    ]
    assert not edits, f"{path.relative_to(ROOT)}: sys.path at line(s) {edits}"
    assert importlib.import_module(name).__file__ == str(path)
