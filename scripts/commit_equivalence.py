"""Do two commits train the same run? The whole of a recipe at each commit, every logged number compared.

Each commit is checked out into its own git worktree and ``r3l fit --config RECIPE`` runs there in a
subprocess with a fixed torch thread count (a run is bit-repeatable only at one thread count on one
machine). Every TensorBoard scalar except measurements of the machine (wall clock, peak memory) is
compared step by step (``refactor_equivalence.compare``); the JSON has the differing tags, the final
validation figures of both runs and the per-step R³L figures.

It answers "did this range of commits change what the recipe learns?" without bisecting: when the two
ends train the same run, no commit in between did (for this recipe, on this machine).

    python -m scripts.commit_equivalence d37f6aa HEAD --recipe configs/examples/r3l_procedural_d1_cpu.yaml \
        --out benchmarks/results/quickstart_code_bisect.json
    python -m scripts.commit_equivalence a59f780 861559e --recipe configs/examples/r3l_procedural_d2_cpu.yaml \
        --fit-args "--trainer.max_steps 240" --out ...     # the warm-start phase only

A change that renames config keys gives each side its own spelling of the same settings
(``--old-fit-args`` / ``--new-fit-args``, after ``--fit-args``). ``--old-scalars FILE`` keeps the old
side's scalars: read when the file exists, else measured and written, so the old side can run once
while the new one is still being written.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from scripts.machine_info import machine_info
from scripts.refactor_equivalence import compare, read_scalars
from scripts.worktrees import add_worktree, remove_worktree

# Shown per step in the JSON: what a reader of an R³L run looks at first.
SHOWN = (
    "rollout/reflection_invalid_rate", "rollout/retry_improvement_rate", "rollout/reflection_outcome_agreement",
    "rollout/success_rate", "val/success_rate_greedy", "val/success_rate",
)


def run_at(commit: str, recipe: str, threads: int, work: str, extra: list[str]) -> dict:
    """The scalars of ``r3l fit --config recipe`` at ``commit`` (tag -> [(step, value)])."""
    tree = str(add_worktree(commit, os.path.join(work, commit)))
    try:
        logs = os.path.join(work, f"logs_{commit}")
        code = (
            f"import sys, torch; torch.set_num_threads({threads}); from r3lightning.cli.main import main; "
            f"main(['fit', '--config', {recipe!r}, '--trainer.logger.init_args.save_dir', {logs!r}, *{extra!r}])"
        )
        env = {**os.environ, "PYTHONPATH": tree, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
        subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True)
        return read_scalars(logs)
    finally:
        remove_worktree(tree)


def last(scalars: dict, tag: str):
    return scalars[tag][-1][1] if scalars.get(tag) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", help="commit (or any revision) of the first run")
    parser.add_argument("new", help="commit of the second run ('-': measure the old one only, into --old-scalars)")
    parser.add_argument("--recipe", default="configs/examples/r3l_procedural_d1_cpu.yaml")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of both runs")
    parser.add_argument("--tol", type=float, default=0.0, help="largest difference counted as equal")
    parser.add_argument("--out", required=True)
    parser.add_argument("--fit-args", default="", help="more `r3l fit` arguments for both runs, one string")
    parser.add_argument("--old-fit-args", default="", help="more `r3l fit` arguments for the old run only")
    parser.add_argument("--new-fit-args", default="", help="more `r3l fit` arguments for the new run only")
    parser.add_argument("--old-scalars", help="the old run's scalars: read if the file exists, else written")
    args = parser.parse_args()
    revs = [subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", r], capture_output=True, text=True,
                           check=True).stdout.strip() if r != "-" else r for r in (args.old, args.new)]
    extra = {side: shlex.split(args.fit_args) + shlex.split(getattr(args, f"{side}_fit_args")) for side in ("old", "new")}
    with tempfile.TemporaryDirectory() as work:
        if args.old_scalars and os.path.isfile(args.old_scalars):
            old = json.loads(Path(args.old_scalars).read_text())
        else:
            old = run_at(revs[0], args.recipe, args.threads, work, extra["old"])
            if args.old_scalars:
                Path(args.old_scalars).write_text(json.dumps(old))
        if args.new == "-":
            return  # the old side only (``--old-scalars``)
        new = run_at(revs[1], args.recipe, args.threads, work, extra["new"])
    problems = compare(old, new, args.tol)
    record = {
        "benchmark": "commit_equivalence",
        "figures": {
            "old_commit": revs[0], "new_commit": revs[1], "tags_compared": len(set(old) | set(new)),
            "differences": problems,
            **{f"{side}_final_{tag}": last(runs, tag) for side, runs in (("old", old), ("new", new))
               for tag in ("val/success_rate_greedy", "val/success_rate")},
        },
        "per_step": {tag: {"old": old.get(tag, []), "new": new.get(tag, [])} for tag in SHOWN},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": machine_info(),
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"{len(problems)} differences" + "".join(f"\n  {p}" for p in problems[:20]))


if __name__ == "__main__":
    main()
