"""Does a warm-started R³L policy act on guidance it could not have guessed? (issue 35)

For every arm (warm-start overrides, ``--arm NAME=KEY=VALUE,...``) and seed: trains the recipe's SFT
warm-start (validated once, at its end), then probes the policy on the recipe's validation tasks. For
each task and each step k of its expert plan, the expert plays the first k actions and the suite's
diagnostician writes the reflection of a mistake at step k (as the warm-start's scripted data does:
"At step k, do 'X' instead of 'Y'"). The policy then continues greedily from step k under three
guidances:

- ``expert``: the suggestion names the expert's next action (what the oracle reflector shows in RL);
- ``alternative``: it names another admissible action, neither the expert's nor the mistake (only the
  guidance can predict it);
- ``none``: no guidance at all (how often the policy takes each of those actions unprompted).

Recorded per run: the warm-start's validation success, and the rate at which the action at step k is
the one named, under each guidance. ``alternative`` against ``none`` is the policy's copying of the
guidance; ``expert`` against ``none`` is what the guidance adds where the observation already implies
the action. Probes where the mistake does not make step k the diagnosed pivot are skipped (counted).

    python -m experiments.guidance_probe --recipe configs/examples/r3l_procedural_d2_cpu.yaml --seeds 0 1 2 \\
        --warmup_steps 240 \\
        --arm share0=model.phases.warmstart.demos.alternative_guidance_share=0,model.phases.warmstart.demos.success_reflection_share=0 \\
        --arm share05=model.phases.warmstart.demos.alternative_guidance_share=0.5,model.phases.warmstart.demos.success_reflection_share=0 \\
        --out benchmarks/results/r3l_d2_issue35/guidance_probe.json

(the recipe as it was on 2026-12-03, when ``guidance_probe.json`` was made: 240 warm-start steps,
neither alternative guidance nor success judgments).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import lightning as L

from scripts.machine_info import machine_info

GUIDANCES = ("expert", "alternative", "none")


def probe_requests(suite, loop, reflector, tasks, rng: random.Random) -> tuple[list, list[dict], int]:
    """(episode requests, one description per request, probes skipped). Three requests per probe, in
    ``GUIDANCES`` order."""
    from r3lightning.envs.textworld_procedural import admissible_actions, replay, world_of
    from r3lightning.rollout.agent_loop import EpisodeRequest

    requests, probes, skipped = [], [], 0
    plans = {task.task_id: list(suite.demonstration(task) or []) for task in tasks}
    tasks = [task for task in tasks if plans[task.task_id]]
    # Every expert plan played once, in one batch: its turns are the prefixes of that task's probes.
    played = loop.play_actions([EpisodeRequest(task=task) for task in tasks], [plans[t.task_id] for t in tasks], allow_unfinished=True)
    for task, episode in zip(tasks, played):
        plan = plans[task.task_id]
        world = world_of(task)
        for k, expert in enumerate(plan):
            admissible = admissible_actions(world, replay(world, plan[:k]))
            others = [a for a in admissible if a != expert]
            if len(others) < 2:
                skipped += 1
                continue
            mistake = rng.choice(others)
            diagnosis = suite.diagnose(task, plan[:k] + [mistake])
            quoted = f"'{expert}'"
            if diagnosis["retry_from_step"] != k or quoted not in diagnosis["improvement_suggestion"]:
                skipped += 1
                continue
            alternative = rng.choice([a for a in others if a != mistake])
            swapped = {**diagnosis, "improvement_suggestion": diagnosis["improvement_suggestion"].replace(quoted, f"'{alternative}'", 1)}
            prefix = episode.turns[:k]
            requests += [
                EpisodeRequest(task=task, prefix=prefix, guidance=reflector.guidance(diagnosis)),
                EpisodeRequest(task=task, prefix=prefix, guidance=reflector.guidance(swapped)),
                EpisodeRequest(task=task, prefix=prefix),
            ]
            probes.append({"task": task.task_id, "k": k, "expert": expert, "alternative": alternative, "mistake": mistake})
    return requests, probes, skipped


def follow_rates(probes: list[dict]) -> dict[str, float]:
    """Share of probes whose action at k is the named one, per guidance; and the unprompted rates."""
    n = max(len(probes), 1)
    return {
        "expert_followed": sum(p["action_expert"] == p["expert"] for p in probes) / n,
        "alternative_followed": sum(p["action_alternative"] == p["alternative"] for p in probes) / n,
        "unguided_takes_expert": sum(p["action_none"] == p["expert"] for p in probes) / n,
        "unguided_takes_alternative": sum(p["action_none"] == p["alternative"] for p in probes) / n,
        "alternative_guidance_takes_expert": sum(p["action_alternative"] == p["expert"] for p in probes) / n,
        "success_expert_guidance": sum(p["success_expert"] for p in probes) / n,
        "success_unguided": sum(p["success_none"] for p in probes) / n,
    }


class GuidanceProbe(L.Callback):
    """At the end of the warm-start: the probes above, greedy, on the suite's validation tasks."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.result: dict = {}

    def on_train_end(self, trainer, module) -> None:
        import torch

        from r3lightning.engines.base import SamplingParams
        from r3lightning.envs.textworld_procedural import normalize_command

        datamodule = trainer.datamodule
        loop, suite = datamodule.connected_loop, datamodule.suite
        requests, probes, skipped = probe_requests(suite, loop, datamodule.reflector, suite.val_tasks(), random.Random(self.seed))
        params = SamplingParams(temperature=0.0, max_new_tokens=datamodule.val_sampling.max_new_tokens)
        with torch.no_grad():
            episodes = loop.run(requests, params)
        for i, probe in enumerate(probes):
            for j, guidance in enumerate(GUIDANCES):
                episode = episodes[3 * i + j]
                actions = episode.actions
                probe[f"action_{guidance}"] = normalize_command(actions[probe["k"]]) if probe["k"] < len(actions) else None
                probe[f"success_{guidance}"] = bool(episode.success)
        self.result = {
            "warmstart_val_success_greedy": float(trainer.callback_metrics["val/success_rate_greedy"]),
            "probes": len(probes),
            "skipped": skipped,
            **follow_rates(probes),
            "records": probes,
        }


def run_one(recipe: str, arm: str, overrides: list[str], seed: int, work: Path, threads: int, steps: int | None) -> dict:
    import torch
    import yaml

    from r3lightning.cli.main import R3LightningCLI

    if threads:
        torch.set_num_threads(threads)
    steps = steps or yaml.safe_load(Path(recipe).read_text())["model"]["phases"]["warmstart"]["steps"]
    start = time.perf_counter()
    cli = R3LightningCLI(
        args=[
            "--config", recipe, "--seed_everything", str(seed), "--data.seed", str(seed),
            "--trainer.max_steps", str(steps), "--model.phases.warmstart.steps", str(steps),
            "--model.phases.warmstart.validate", "false",
            "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(work), "--trainer.logger.init_args.name", f"{arm}_seed{seed}",
            *overrides,
        ],
        run=False,
    )
    probe = GuidanceProbe(seed)
    cli.trainer.callbacks.append(probe)
    cli.trainer.fit(cli.model, cli.datamodule)
    return {**probe.result, "wall_s": time.perf_counter() - start}


def parse_arm(spec: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE,KEY=VALUE`` (or ``NAME=`` for the recipe as it is) -> (name, CLI arguments)."""
    from experiments.compare_algorithms import key_value_args

    name, _, rest = spec.partition("=")
    args: list[str] = []
    for pair in filter(None, rest.split(",")):
        if "=" not in pair:
            raise ValueError(f"--arm {spec!r}: {pair!r} is not KEY=VALUE")
        args += key_value_args(pair)
    return name, args


def summarize(runs: dict[str, dict[str, dict]]) -> dict:
    keys = ("warmstart_val_success_greedy", "expert_followed", "alternative_followed", "unguided_takes_expert",
            "unguided_takes_alternative", "success_expert_guidance", "success_unguided")
    figures = {}
    for arm, seeds in runs.items():
        for key in keys:
            values = [run[key] for run in seeds.values()]
            figures[f"{arm}/{key}_mean"] = statistics.mean(values)
            figures[f"{arm}/{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
            figures[f"{arm}/{key}_per_seed"] = values
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="configs/examples/r3l_procedural_d2_cpu.yaml")
    parser.add_argument("--arm", action="append", required=True, help="NAME=KEY=VALUE,... (warm-start overrides)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="runs/guidance_probe", help="logs; finished runs are kept in <work>/results and not run again")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup_steps", type=int, default=None, help="SFT warm-start steps; default: the recipe's")
    args = parser.parse_args()
    os.chdir(ROOT)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = (ROOT / args.work).resolve()
    done = work / "results"
    done.mkdir(parents=True, exist_ok=True)
    arms = dict(parse_arm(spec) for spec in args.arm)
    runs: dict[str, dict[str, dict]] = {arm: {} for arm in arms}
    for seed in args.seeds:
        for arm, overrides in arms.items():
            path = done / f"{arm}_seed{seed}.json"
            if not path.exists():
                path.write_text(json.dumps(run_one(args.recipe, arm, overrides, seed, work, args.threads, args.warmup_steps)) + "\n")
            runs[arm][str(seed)] = json.loads(path.read_text())
            run = runs[arm][str(seed)]
            print(f"{arm} seed {seed}: " + json.dumps({k: v for k, v in run.items() if k != "records"}), flush=True)
    record = {
        "benchmark": "guidance_probe",
        "figures": summarize(runs),
        "per_seed": runs,
        "config": {"recipe": args.recipe, "arms": arms, "seeds": args.seeds, "threads": args.threads, "warmup_steps": args.warmup_steps},
        "machine": machine_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
