"""Where do R³L's pivots fall, and what do its retries do with the guidance?

Resumes a warm-start checkpoint of a procedural-world recipe with an R³L preset (``--preset``, default
``r3l``; ``r3l_oracle``: the suite's diagnostician reflects) for a few RL steps and records, for every
base trajectory the explorer reflected on: the task's shortest-plan length, the episode's length and
outcome, the pivot the reflection chose (when valid), and the pivot and outcome the suite's scripted
diagnostician gives for the same actions (the first step that did not bring the goal closer). The JSON
holds both histograms, the share of pivots k > 0, and the joint counts.

For every retry (the distilled member that follows its base in a group) it also records what the
retry did at its pivot: whether its action there is the one the reflection's suggestion names
(``'...'`` quoted first in it), whether every action after the pivot stayed on a shortest path, and
whether the retry succeeded; summarized as ``guidance_followed_rate``, ``retry_on_shortest_path_rate``
and the retry success rate, by whether the guidance was followed. That separates "the policy does
not follow the guidance" from "it follows it and then goes astray".

    python -m experiments.pivot_analysis --recipe configs/examples/r3l_procedural_d1_cpu.yaml --ckpt WARM.ckpt --steps 5 \\
        --out benchmarks/results/pivot_analysis_quickstart.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import lightning as L

from scripts.machine_info import machine_info


class PivotRecorder(L.Callback):
    """After each RL step: one record per reflected base trajectory of the step."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.retries: list[dict] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        from r3lightning.envs.textworld_procedural import shortest_plan, world_of
        from r3lightning.rollout.explorers.reflection import parse_reflection

        suite = trainer.datamodule.suite
        tasks = {task.task_id: task for task in batch.tasks}
        previous = None
        for trajectory in outputs["trajectories"]:
            if trajectory.origin == "distilled" and previous is not None and previous.task_id == trajectory.task_id:
                self.retries.append(retry_record(trainer.global_step, tasks[trajectory.task_id], previous, trajectory))
            previous = trajectory
            if trajectory.origin != "base" or "reflection" not in trajectory.info:
                continue
            task = tasks[trajectory.task_id]
            policy, error = parse_reflection(trajectory.info["reflection"], len(trajectory.turns))
            scripted = suite.diagnose(task, trajectory.actions, [t.feedback for t in trajectory.turns])
            world = world_of(task)
            self.records.append({
                "step": trainer.global_step,
                "plan_length": len(shortest_plan(world, world.start)),
                "turns": len(trajectory.turns),
                "success": trajectory.success,
                "policy_pivot": policy.retry_from_step if policy is not None else None,
                "policy_outcome": policy.trajectory_outcome if policy is not None else None,
                "policy_error": error,
                "diagnosed_pivot": int(scripted["retry_from_step"]),
                "diagnosed_outcome": scripted["trajectory_outcome"],
            })


def retry_record(step: int, task, base, retry) -> dict:
    """What the retry of ``base`` did at its pivot against the suggestion of ``base``'s reflection."""
    from r3lightning.envs.textworld_procedural import apply_action, goal_reached, normalize_command, replay, shortest_plan, world_of
    from r3lightning.rollout.explorers.reflection import parse_reflection

    reflection, _ = parse_reflection(base.info["reflection"], len(base.turns))
    pivot = retry.pivot or 0
    quoted = re.findall(r"'([^']+)'", reflection.improvement_suggestion) if reflection is not None else []
    suggested = normalize_command(quoted[0]) if quoted else None
    actions = [normalize_command(a) for a in retry.actions]
    world = world_of(task)
    state, on_path = world.start, True
    for index, action in enumerate(actions):
        outcome = apply_action(world, state, action)
        if index >= pivot and len(shortest_plan(world, outcome.state)) != len(shortest_plan(world, state)) - 1:
            on_path = False
        state = outcome.state
        if goal_reached(world, state):
            break
    return {
        "step": step,
        "pivot": pivot,
        "suggested": suggested,
        "action_at_pivot": actions[pivot] if pivot < len(actions) else None,
        "followed": suggested is not None and pivot < len(actions) and actions[pivot] == suggested,
        "on_shortest_path_after_pivot": on_path,
        "base_success": base.success,
        "retry_success": retry.success,
        "base_turns": len(base.turns),
        "retry_turns": len(retry.turns),
        # From the state the guidance was given in.
        "remaining_plan": len(shortest_plan(world, replay(world, actions[:pivot]))),
    }


def summarize_retries(retries: list[dict]) -> dict:
    followed = [r for r in retries if r["followed"]]
    ignored = [r for r in retries if not r["followed"]]
    failed_base = [r for r in retries if not r["base_success"]]

    def rate(rows, key):
        return sum(r[key] for r in rows) / len(rows) if rows else None

    return {
        "retries": len(retries),
        "guidance_followed_rate": rate(retries, "followed"),
        "retry_on_shortest_path_rate": rate(retries, "on_shortest_path_after_pivot"),
        "retry_success_rate": rate(retries, "retry_success"),
        "retry_success_rate_when_followed": rate(followed, "retry_success"),
        "retry_success_rate_when_not_followed": rate(ignored, "retry_success"),
        "retry_success_rate_of_failed_bases": rate(failed_base, "retry_success"),
        "base_success_rate_of_retried": rate(retries, "base_success"),
        "pivot_histogram": dict(sorted(collections.Counter(r["pivot"] for r in retries).items())),
        "remaining_plan_histogram": dict(sorted(collections.Counter(r["remaining_plan"] for r in retries).items())),
    }


def summarize(records: list[dict]) -> dict:
    valid = [r for r in records if r["policy_pivot"] is not None]
    failures = [r for r in records if not r["success"]]
    joint = collections.Counter((r["policy_pivot"], r["diagnosed_pivot"]) for r in valid)
    return {
        "reflections": len(records),
        "valid": len(valid),
        "policy_pivot_histogram": dict(sorted(collections.Counter(r["policy_pivot"] for r in valid).items())),
        "diagnosed_pivot_histogram_failures": dict(sorted(collections.Counter(r["diagnosed_pivot"] for r in failures).items())),
        "policy_late_pivot_share": sum(r["policy_pivot"] > 0 for r in valid) / max(len(valid), 1),
        "diagnosed_late_pivot_share_failures": sum(r["diagnosed_pivot"] > 0 for r in failures) / max(len(failures), 1),
        "policy_matches_diagnosed_pivot": sum(r["policy_pivot"] == r["diagnosed_pivot"] for r in valid) / max(len(valid), 1),
        "plan_length_histogram": dict(sorted(collections.Counter(r["plan_length"] for r in records).items())),
        "turns_histogram_failures": dict(sorted(collections.Counter(r["turns"] for r in failures).items())),
        "joint_policy_vs_diagnosed": {f"{p}->{d}": n for (p, d), n in sorted(joint.items())},
        "success_rate": sum(r["success"] for r in records) / max(len(records), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--ckpt", required=True, help="a warm-start checkpoint of the recipe (experiments/compare_algorithms.py writes them)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--preset", default="r3l", help="an R³L preset in configs/algorithms (r3l, r3l_oracle...)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--extra", nargs="*", default=[], help="further CLI arguments (e.g. --data.suite.init_args.max_turns 8)")
    args = parser.parse_args()
    os.chdir(ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import yaml

    from r3lightning.cli.main import R3LightningCLI

    checkpoint = torch.load(args.ckpt, map_location="cpu", weights_only=False)
    warm = int(checkpoint["global_step"])
    recipe = yaml.safe_load(Path(args.recipe).read_text())
    cli = R3LightningCLI(
        args=[
            "--config", args.recipe, "--config", f"configs/algorithms/{args.preset}.yaml",
            "--model.phases.warmstart.steps", str(recipe["model"]["phases"]["warmstart"]["steps"]),
            "--trainer.max_steps", str(warm + args.steps), "--trainer.limit_val_batches", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", *args.extra,
        ],
        run=False,
    )
    recorder = PivotRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=args.ckpt)
    result = {
        "benchmark": "pivot_analysis",
        "figures": {**summarize(recorder.records), "retries": summarize_retries(recorder.retries)},
        "config": {"recipe": args.recipe, "preset": args.preset, "ckpt": os.path.basename(args.ckpt), "warm_steps": warm,
                   "rl_steps": args.steps, "extra": args.extra},
        "machine": machine_info(),
        "records": recorder.records,
        "retry_records": recorder.retries,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["figures"], indent=1))


if __name__ == "__main__":
    main()
