"""Docs name only what exists: every repository path a page names (``configs/...``, ``r3lightning/...``,
``tests/...``; a glob matches something) and every algorithm preset it names (``configs/algorithms/<name>.yaml``),
so a user who follows a page never meets ``File does not exist``."""

import re

import pytest
from harness import CONFIGS, ROOT

DOCS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md"])
REPO_PATH = re.compile(r"(?<![\w/.<>-])((?:configs|r3lightning|tests|docs|benchmarks|experiments|scripts|callbacks)/[\w./*-]*[\w*])")
PRESET = re.compile(r"preset `([\w.]+)`")
PRESETS_ROW = re.compile(r"^\| `configs/algorithms/` \|.*\| (.*) \|$", re.MULTILINE)
INSTALLED_AS = {"r3lightning/callbacks": "callbacks"}
"""Paths that exist in an install (``pyproject.toml``'s ``package-dir``) under another name in the repository."""


def named_paths(text: str) -> list[str]:
    return [m.rstrip(".") for m in REPO_PATH.findall(text)]


def exists(path: str) -> bool:
    path = INSTALLED_AS.get(path, path)
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_path_a_doc_names_exists(doc):
    missing = sorted({p for p in named_paths(doc.read_text()) if not exists(p)})
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_preset_a_doc_names_exists(doc):
    text = doc.read_text()
    names = set(PRESET.findall(text))
    for row in PRESETS_ROW.findall(text):
        names |= set(re.findall(r"`(\w+)`", row))
    missing = sorted(n for n in names if not (CONFIGS / "algorithms" / f"{n.removesuffix('.yaml')}.yaml").is_file())
    assert not missing, f"{doc.name} names algorithm presets that do not exist: {missing}"


def test_the_checks_see_a_missing_path_and_a_missing_preset():
    assert named_paths("see `configs/algorithms/reflectrl.yaml`.") == ["configs/algorithms/reflectrl.yaml"]
    assert not exists("configs/algorithms/reflectrl.yaml") and exists("configs/examples/*.yaml")
    assert exists("r3lightning/callbacks") and not exists("experiments/nothing_*.py")
