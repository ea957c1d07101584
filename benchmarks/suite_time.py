"""Test-suite time of two commits, like for like: the README's test command run on a git worktree of
each, alternating (A, B, A, B, ...), same virtual environment, so that machine drift falls on both.

CI's wall time is install + this command; the install is the same for both commits, so the suite is
what a change can make slower. Reports each run's wall time, its pytest summary line and the ratio
B / A per round.

In a worktree the package is imported from the worktree (``PYTHONPATH``) while the editable install
still maps ``r3lightning.callbacks`` to the main checkout; a symlink puts the worktree's own callbacks
there instead (``scripts.worktrees.add_worktree``). That layout puts a top-level ``callbacks`` on the path, so
``tests/test_layers.py::test_callbacks_install_under_the_package_name`` fails in both worktrees (at
its first line, so it costs both the same). Each run gets an empty inductor cache directory, so tests
that compile pay the compilation a fresh CI machine pays.

    python -m benchmarks.suite_time b80d8ea HEAD --rounds 2 --out benchmarks/results/suite_time_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from scripts.machine_info import machine_info
from scripts.worktrees import add_worktree, remove_worktree

TEST_COMMAND = ["-m", "pytest", "-m", "not slow and not gpu", "-q", "-p", "no:cacheprovider"]


def run_suite(tree: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as inductor_cache:
        # Tests that compile with inductor start cold, as on a fresh CI machine.
        env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *TEST_COMMAND], cwd=tree, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
    lines = done.stdout.strip().splitlines()
    return {"wall_s": round(wall, 1), "summary": lines[-1] if lines else done.stderr[-300:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="the reference commit")
    parser.add_argument("b", help="the commit compared with it")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    revs = [subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", r], capture_output=True, text=True,
                           check=True).stdout.strip() for r in (args.a, args.b)]
    runs: dict[str, list[dict]] = {rev: [] for rev in revs}
    with tempfile.TemporaryDirectory() as parent:
        trees = {rev: add_worktree(rev, Path(parent) / rev) for rev in revs}
        try:
            for round_ in range(args.rounds):
                for rev in revs:
                    runs[rev].append(run_suite(trees[rev]))
                    print(f"round {round_ + 1} {rev}: {json.dumps(runs[rev][-1])}", flush=True)
        finally:
            for tree in trees.values():
                remove_worktree(tree)
    a, b = revs
    ratios = [round(rb["wall_s"] / ra["wall_s"], 3) for ra, rb in zip(runs[a], runs[b])]
    result = {
        "benchmark": "suite_time",
        "figures": {f"{b}_over_{a}_per_round": ratios, f"{b}_over_{a}_median": statistics.median(ratios)},
        "config": {"a": a, "b": b, "rounds": args.rounds, "command": "python " + " ".join(TEST_COMMAND), "runs": runs},
        "machine": machine_info(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["figures"], indent=2))


if __name__ == "__main__":
    main()
