"""Imports point one way: algos ← envs ← engines ← rollout ← data ← module ← checkpointing ← callbacks ← cli.

Every module of the package (and of ``callbacks/``, installed as ``r3lightning.callbacks``) is read
with ``ast``, imports inside functions included. Three checks, each proven on a planted violation in
a fixture package: an import of a higher layer, an import cycle between modules, and a package module
or class named by a string in code (a ``"r3lightning.callbacks.X"`` class path, an ``import_module``
of a package module), which an import check cannot see.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "r3lightning.algos": 0,
    "r3lightning.types": 0,
    "r3lightning.envs": 1,
    "r3lightning.engines": 2,
    "r3lightning.rollout": 3,
    "r3lightning.data": 4,
    "r3lightning.training": 5,
    "r3lightning.module": 5,
    "r3lightning.checkpointing": 6,
    "r3lightning.callbacks": 7,
    "r3lightning.cli": 8,
}
NAMES = {0: "algos", 1: "envs", 2: "engines", 3: "rollout", 4: "data", 5: "module", 6: "checkpointing", 7: "callbacks", 8: "cli"}


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> int | None:
    for prefix, layer in sorted(layers.items(), key=lambda item: -len(item[0])):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "callbacks":
        parts = ["r3lightning", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_files() -> list[Path]:
    return sorted([*(ROOT / "r3lightning").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")])


def package_modules(files: list[Path], root: Path = ROOT) -> dict[str, Path]:
    return {module_name(path, root): path for path in files}


def imported_modules(path: Path, name: str, known: set[str]) -> list[str]:
    """The modules ``path`` (module ``name``) imports, anywhere in the file: for ``from X import n``,
    ``X.n`` when that is a module of ``known``, else ``X``; relative imports resolved against ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    return found


def upward_imports(modules: dict[str, Path], layers: dict[str, int], names: dict[int, str], root: Path = ROOT) -> list[str]:
    violations = []
    for name, path in modules.items():
        own = layer_of(name, layers)
        if own is None:
            continue
        for target in imported_modules(path, name, set(modules)):
            if target == "callbacks" or target.startswith("callbacks."):
                violations.append(f"{path.relative_to(root)} imports {target} (use r3lightning.callbacks)")
                continue
            layer = layer_of(target, layers)
            if layer is not None and layer > own:
                violations.append(f"{path.relative_to(root)} ({names[own]}) imports {target} ({names[layer]})")
    return violations


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Every set of package modules that import each other in a circle (strongly connected components of
    the import graph with more than one module, or a module importing itself), each sorted."""
    graph = {}
    for name, path in modules.items():
        targets = set()
        for target in imported_modules(path, name, set(modules)):
            while target and target not in modules:
                target = target.rpartition(".")[0]  # "pkg.mod.Class" (or a name in pkg/__init__) -> its module
            if target:
                targets.add(target)
        graph[name] = sorted(targets)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def string_imports(modules: dict[str, Path], package: str, root: Path = ROOT) -> list[str]:
    """Strings in code (not docstrings or other bare string statements) that name a module of the package
    (``"<package>.<module>..."``, in full or as an f-string's start): a class path or an ``import_module``
    the import checks cannot see. A ``find_spec`` argument is allowed: it locates a module without
    importing it."""
    tops = {name.split(".")[1] for name in modules if name.count(".") >= 1}
    dotted = re.compile(rf"{re.escape(package)}\.({'|'.join(map(re.escape, sorted(tops)))})(\.[A-Za-z_]\w*)*")
    violations = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        allowed = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                allowed.add(id(node.value))  # a docstring or another bare string: text, not code
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "find_spec":
                allowed.update(id(arg) for arg in node.args)
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                text, whole = node.values[0].value, False
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed:
                text, whole = node.value, True
            else:
                continue
            match = dotted.fullmatch(text) if whole else dotted.match(text)
            if match:
                violations.append((str(path.relative_to(root)), node.lineno, text))
    return [f"{file}:{line} names {text!r} in a string (import it)" for file, line, text in sorted(violations)]


def test_every_package_module_has_a_layer():
    missing = [name for name in package_modules(package_files()) if name != "r3lightning" and layer_of(name) is None]
    assert not missing, f"modules without a layer in tests/test_layers.py: {missing}"


def test_imports_point_down_the_layers():
    violations = upward_imports(package_modules(package_files()), LAYERS, NAMES)
    assert not violations, "\n".join(violations)


def test_no_import_cycle_in_the_package():
    cycles = import_cycles(package_modules(package_files()))
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_package_module_is_named_by_a_string():
    violations = string_imports(package_modules(package_files()), "r3lightning")
    assert not violations, "\n".join(violations)


def planted(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    """A fixture package ``fixture`` made of ``files`` (path under ``fixture/`` -> source)."""
    for relative, source in {"__init__.py": "", **files}.items():
        path = tmp_path / "fixture" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return package_modules(sorted((tmp_path / "fixture").rglob("*.py")), tmp_path)


def test_the_layer_check_fails_on_a_planted_upward_import(tmp_path):
    modules = planted(tmp_path, {"low.py": "def f():\n    from fixture.high import g\n", "high.py": "import fixture.low\n"})
    layers, names = {"fixture.low": 0, "fixture.high": 1}, {0: "low", 1: "high"}
    assert upward_imports(modules, layers, names, tmp_path) == ["fixture/low.py (low) imports fixture.high (high)"]
    modules["fixture.low"].write_text("import os\n")
    assert upward_imports(modules, layers, names, tmp_path) == []


def test_the_cycle_check_fails_on_a_planted_cycle(tmp_path):
    """A cycle through a function-level import and a relative import (what ``checkpoints`` <->
    ``module`` was), and one of three modules; a plain chain is no cycle."""
    modules = planted(tmp_path, {
        "a.py": "from fixture.b import thing\n",
        "b.py": "thing = 1\ndef load():\n    from . import a\n",
        "sub/__init__.py": "",
        "sub/x.py": "from fixture.sub.y import Y\n",
        "sub/y.py": "import fixture.sub.z\nY = 1\n",
        "sub/z.py": "from fixture.sub import x\n",
        "chain.py": "import fixture.a\n",
    })
    assert import_cycles(modules) == [["fixture.a", "fixture.b"], ["fixture.sub.x", "fixture.sub.y", "fixture.sub.z"]]
    modules["fixture.b"].write_text("thing = 1\n")
    modules["fixture.sub.z"].write_text("import os\n")
    assert import_cycles(modules) == []


def test_the_string_import_check_fails_on_a_planted_class_path(tmp_path):
    """A class path constant, an ``import_module`` of a package module and an f-string class path are
    found; docstrings, messages, ``find_spec`` and other packages' class paths are not."""
    modules = planted(tmp_path, {
        "callbacks.py": "class Report:\n    pass\n",
        "cli.py": (
            '"""Adds fixture.callbacks.Report (a docstring)."""\n'
            "import importlib\n"
            'REPORT = "fixture.callbacks.Report"\n'
            "def load(name):\n"
            '    """Imports fixture.callbacks.Report."""\n'
            '    importlib.import_module("fixture.callbacks")\n'
            '    return f"fixture.callbacks.{name}"\n'
            'LOGGER = {"class_path": "lightning.pytorch.loggers.TensorBoardLogger"}\n'
            'MESSAGE = "see fixture.callbacks.Report for the report"\n'
            'FIELD = f"fixture.{LOGGER}"\n'
            'SPEC = importlib.util.find_spec("fixture.callbacks")\n'
        ),
    })
    found = string_imports(modules, "fixture", tmp_path)
    assert [line.split(" names ")[0] for line in found] == ["fixture/cli.py:3", "fixture/cli.py:6", "fixture/cli.py:7"], found
    modules["fixture.cli"].write_text("from fixture.callbacks import Report\nREPORT = Report\n")
    assert string_imports(modules, "fixture", tmp_path) == []


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
