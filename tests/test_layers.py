"""Imports point one way: algos ← envs, engines ← rollout ← data ← module ← cli, callbacks above the module.

Every module of the package (and of ``callbacks/``, installed as ``r3lightning.callbacks``) is read
with ``ast``; an import of a higher layer fails the test with the file and the import. The package
never imports the callbacks: the CLI names its default callbacks by class path.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "r3lightning.algos": 0,
    "r3lightning.types": 0,
    "r3lightning.state_checks": 0,
    "r3lightning.envs": 1,
    "r3lightning.engines": 1,
    "r3lightning.rollout": 2,
    "r3lightning.data": 3,
    "r3lightning.models": 4,
    "r3lightning.optim": 4,
    "r3lightning.checkpoints": 4,
    "r3lightning.checkpoint_io": 4,
    "r3lightning.checkpoint_state": 4,
    "r3lightning.module": 4,
    "r3lightning.forward": 4,
    "r3lightning.loss": 4,
    "r3lightning.cli": 5,
    "r3lightning.config_yaml": 0,
    "r3lightning.console": 5,
    "r3lightning.export": 5,
    "r3lightning.resume_check": 5,
    "r3lightning.callbacks": 6,
}
NAMES = {0: "algos", 1: "envs/engines", 2: "rollout", 3: "data", 4: "module", 5: "cli", 6: "callbacks"}


def layer_of(module: str) -> int | None:
    for prefix, layer in sorted(LAYERS.items(), key=lambda item: -len(item[0])):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "callbacks":
        parts = ["r3lightning", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # "from r3lightning import algos" imports the subpackage.
            found += [f"{node.module}.{alias.name}" if node.module == "r3lightning" else node.module for alias in node.names]
    return found


def package_files() -> list[Path]:
    return sorted([*(ROOT / "r3lightning").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")])


def test_every_package_module_has_a_layer():
    missing = [module_name(p) for p in package_files() if module_name(p) != "r3lightning" and layer_of(module_name(p)) is None]
    assert not missing, f"modules without a layer in tests/test_layers.py: {missing}"


def test_imports_point_down_the_layers():
    violations = []
    for path in package_files():
        own = layer_of(module_name(path))
        if own is None:
            continue
        for target in imported_modules(path):
            if target == "callbacks" or target.startswith("callbacks."):
                violations.append(f"{path.relative_to(ROOT)} imports {target} (use r3lightning.callbacks)")
                continue
            layer = layer_of(target)
            if layer is not None and layer > own:
                violations.append(f"{path.relative_to(ROOT)} ({NAMES[own]}) imports {target} ({NAMES[layer]})")
    assert not violations, "\n".join(violations)


def test_algos_import_no_framework_and_experience_no_lightning():
    """``r3lightning.algos`` is pure torch (no Lightning, transformers or vLLM), and the experience
    collation in ``r3lightning.data.experience`` imports no Lightning; one fresh process checks both."""
    code = (
        "import sys, r3lightning.algos\n"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning', 'transformers', 'vllm') if m in sys.modules))\n"
        "import r3lightning.data.experience\n"
        "print(sorted(m for m in ('lightning', 'pytorch_lightning') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.split("\n")[:2] == ["[]", "[]"], out.stdout


def test_callbacks_install_under_the_package_name(tmp_path):
    """Outside the checkout, ``import callbacks`` finds nothing and ``r3lightning.callbacks`` is the
    checkout's callbacks package (located, not imported: importing it there would only repeat, at the
    cost of a fresh Lightning import, what the callback tests import in this process)."""
    code = (
        "import importlib.util\n"
        "assert importlib.util.find_spec('callbacks') is None, importlib.util.find_spec('callbacks')\n"
        "print(importlib.util.find_spec('r3lightning.callbacks').origin)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).read_text() == (ROOT / "callbacks" / "__init__.py").read_text()  # editable or not
    from r3lightning.callbacks import PhaseReport, VLLMWeightSync  # noqa: F401  (and it imports)
