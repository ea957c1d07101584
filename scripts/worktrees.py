"""Git worktrees of other commits, for benchmarks that measure two commits side by side."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_worktree(commit: str, tree: str | Path) -> Path:
    """Check ``commit`` out at ``tree`` (detached). Where its callbacks live beside the package, a
    symlink puts them under ``r3lightning/callbacks``, where the editable install would map them."""
    tree = Path(tree)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", "-q", str(tree), commit], check=True)
    if (tree / "callbacks").is_dir() and not os.path.lexists(tree / "r3lightning" / "callbacks"):
        (tree / "r3lightning" / "callbacks").symlink_to("../callbacks")
    return tree


def remove_worktree(tree: str | Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
