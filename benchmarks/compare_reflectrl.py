"""ReflectRL vs the "GT+ only" pipeline, from one expert pool, at equal steps, with GRPO and with RLOO.

Both pipelines run configs/examples/reflectrl_arithmetic_cpu.yaml's schedule (stage 1: SFT warm-start;
stage 2: RL on direct prompts) on the same GNT pool (one expert, one pool: ``--pool``, e.g. the one
benchmarks/reflectrl_example.py wrote):

- ``reflectrl``: stage 1 = SFT on GT+ answers + verified scripted critiques of the GNTs (reflective
  prompts); stage 2 = the RL objective + beta * KL(student || stage-1 teacher) (the example's beta).
- ``gtplus``: stage 1 = SFT on the GT+ answers only (``r3l reflect-sft --no_reflective``); stage 2 = the
  RL objective alone (the callback with beta 0: the data turns direct at the same step, no teacher).

Per seed: the SFT files are shuffled with the seed, each pipeline's stage 1 is trained once and
checkpointed, and each objective (``grpo``: the example's; ``rloo``: + configs/algorithms/rloo.yaml)
resumes from it for the same RL steps (``data.seed`` = the seed). ``--ablation_betas`` adds GRPO arms
that start from ReflectRL's stage 1 with another teacher-KL weight (``reflectrl_beta0`` is ReflectRL
without the distillation term). Recorded per run: validation success after stage 1 (reflective with
the GNT in context, and direct) and after stage 2 (direct), greedy and sampled, and response lengths.

    nice -n 19 python benchmarks/compare_reflectrl.py --pool runs/reflectrl_example/pool.jsonl \
        --out benchmarks/results/compare_reflectrl.json --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine_info import machine_info  # noqa: E402

STUDENT_YAML = ROOT / "configs" / "examples" / "reflectrl_arithmetic_cpu.yaml"
OBJECTIVES = {"grpo": [], "rloo": ["--config", str(ROOT / "configs" / "algorithms" / "rloo.yaml")]}
PIPELINES = ("reflectrl", "gtplus")


def student_config(args: argparse.Namespace, pipeline: str, sft: Path, logs: Path, name: str) -> dict:
    config = yaml.safe_load(STUDENT_YAML.read_text())
    config["trainer"]["logger"]["init_args"].update(save_dir=str(logs), name=name)
    config["data"]["suite"]["init_args"]["pool"] = str(Path(args.pool).resolve())
    config["data"]["demos"]["source"] = str(sft)
    [callback] = config["trainer"]["callbacks"]
    if pipeline == "gtplus":
        callback["init_args"]["beta"] = 0.0
    elif args.beta is not None:
        callback["init_args"]["beta"] = args.beta
    return config


def build_sft(args: argparse.Namespace, seed: int, work: Path) -> dict[str, Path]:
    """The two stage-1 SFT files of ``seed`` (``reflectrl``: GT+ and critiques; ``gtplus``: GT+ only)."""
    files = {}
    for pipeline, extra in (("reflectrl", ["--critic", "scripted"]), ("gtplus", ["--no_reflective"])):
        out = work / f"sft_{pipeline}_seed{seed}.jsonl"
        files[pipeline] = out
        if Path(f"{out}.summary.json").exists():
            continue
        subprocess.run(
            [sys.executable, "-c", "from r3lightning.cli import main; main()", "reflect-sft", "--config", str(STUDENT_YAML),
             "--pool", args.pool, "--out", str(out), "--seed", str(seed), *extra],
            check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    return files


def _fit(config_path: Path, extra: list[str]):
    from r3lightning.callbacks import PhaseReport, ReflectiveToDirectDistillation
    from r3lightning.cli import R3LightningCLI

    cli = R3LightningCLI(args=["fit", "--config", str(config_path), "--trainer.enable_progress_bar", "false", *extra])
    report = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PhaseReport))
    distill = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ReflectiveToDirectDistillation))
    return cli, report, distill


def stage_one(pipeline: str, seed: int, config_path: str, checkpoint: str, threads: int, result_path: str) -> dict:
    """Train stage 1 (the warm-start, ending with the switch-step validation) and checkpoint it; the
    result is also written to ``result_path`` (by the worker: an interrupted comparison keeps it)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    config = yaml.safe_load(Path(config_path).read_text())
    steps = config["model"]["phases"]["sft_warmup_steps"]
    cli, _, distill = _fit(Path(config_path), ["--seed_everything", str(seed), "--data.seed", str(seed), "--trainer.max_steps", str(steps)])
    cli.trainer.save_checkpoint(checkpoint)
    result = {"records": distill.records, "wall_s": time.perf_counter() - start}
    Path(result_path).write_text(json.dumps(result))
    return result


def stage_two(pipeline: str, objective: str, seed: int, config_path: str, checkpoint: str, threads: int, result_path: str) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    start = time.perf_counter()
    _, report, distill = _fit(
        Path(config_path),
        ["--seed_everything", str(seed), "--data.seed", str(seed), *OBJECTIVES[objective], "--ckpt_path", checkpoint,
         "--resume_with", "config"],  # each objective's own algorithm over the shared stage 1
    )
    if pipeline.startswith("reflectrl_beta"):
        assert distill.beta == float(pipeline[len("reflectrl_beta"):]), "the ablation's beta did not apply"
    stage1 = [r for r in distill.records if r["stage"] == 1][-1]
    stage2 = [r for r in distill.records if r["stage"] == 2][-1]
    means = report.rollout_means()
    result = {
        "stage1_reflective_greedy": stage1["val/success_rate_greedy"],
        "stage1_reflective_sampled": stage1["val/success_rate"],
        "stage1_direct_greedy": stage1.get("val_direct/success_rate_greedy"),
        "stage1_direct_sampled": stage1.get("val_direct/success_rate"),
        "stage1_direct_response_len": stage1.get("val_direct/response_len"),
        "final_direct_greedy": stage2["val/success_rate_greedy"],
        "final_direct_sampled": stage2["val/success_rate"],
        "final_direct_response_len_greedy": stage2.get("val/response_len_greedy"),
        "rl_rollout_response_len_mean": means.get("rollout/response_len"),
        "records": distill.records,
        "wall_s": time.perf_counter() - start,
    }
    Path(result_path).write_text(json.dumps(result))
    return result


def summarize(runs: dict[str, dict[str, dict]]) -> dict[str, float]:
    figures = {}
    keys = ("stage1_reflective_greedy", "stage1_direct_greedy", "final_direct_greedy", "final_direct_sampled",
            "final_direct_response_len_greedy", "rl_rollout_response_len_mean")
    for arm, seeds in runs.items():
        for key in keys:
            values = [run[key] for run in seeds.values() if run.get(key) is not None]
            if values:
                figures[f"{arm}/{key}_mean"] = statistics.mean(values)
                figures[f"{arm}/{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", required=True, help="the GNT pool every seed and pipeline shares (r3l gnt-pool --out)")
    parser.add_argument("--out", default="benchmarks/results/compare_reflectrl.json")
    parser.add_argument("--work", default="runs/compare_reflectrl", help="configs, SFT files, checkpoints and logs")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--beta", type=float, default=None, help="ReflectRL's teacher-KL weight (default: the example's)")
    parser.add_argument("--ablation_betas", nargs="*", type=float, default=[],
                        help="extra GRPO arms from ReflectRL's stage 1 with these teacher-KL weights (0: no distillation)")
    parser.add_argument("--workers", type=int, default=1, help="runs in parallel (separate processes)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per run (0: torch's default)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = (ROOT / args.work).resolve()
    logs = work / "logs"
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    configs, checkpoints, stage1 = {}, {}, {}
    for seed in args.seeds:
        sft = build_sft(args, seed, work)
        for pipeline in PIPELINES:
            path = work / f"{pipeline}_seed{seed}.yaml"
            path.write_text(yaml.safe_dump(student_config(args, pipeline, sft[pipeline], logs, f"{pipeline}_seed{seed}"), sort_keys=False))
            configs[pipeline, seed] = str(path)
            checkpoints[pipeline, seed] = str(work / f"{pipeline}_seed{seed}_stage1.ckpt")
    context = multiprocessing.get_context("spawn")
    # Finished runs are kept in <work>/results/ and not run again, so an interrupted comparison resumes.
    done_dir = work / "results"
    done_dir.mkdir(exist_ok=True)
    for key in configs:
        path = done_dir / f"stage1_{key[0]}_seed{key[1]}.json"
        if path.exists() and Path(checkpoints[key]).exists():
            stage1[key] = json.loads(path.read_text())
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool:
        futures = {
            pool.submit(stage_one, p, s, configs[p, s], checkpoints[p, s], args.threads, str(done_dir / f"stage1_{p}_seed{s}.json")): (p, s)
            for p, s in configs if (p, s) not in stage1
        }
        for future in as_completed(futures):
            p, s = futures[future]
            stage1[p, s] = future.result()
            print(f"stage 1 {p} seed {s}: {json.dumps(stage1[p, s]['records'][-1:])}", flush=True)
    jobs = [(p, o, s, configs[p, s], checkpoints[p, s]) for s in args.seeds for o in args.objectives for p in PIPELINES]
    for beta in args.ablation_betas:
        name = f"reflectrl_beta{beta:g}"
        for seed in args.seeds:
            config = yaml.safe_load(Path(configs["reflectrl", seed]).read_text())
            config["trainer"]["callbacks"][0]["init_args"]["beta"] = beta
            config["trainer"]["logger"]["init_args"]["name"] = f"{name}_seed{seed}"
            path = work / f"{name}_seed{seed}.yaml"
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            jobs.append((name, "grpo", seed, str(path), checkpoints["reflectrl", seed]))
    runs: dict[str, dict[str, dict]] = {f"{p}_{o}": {} for p, o, *_ in jobs}
    for p, o, s, *_ in jobs:
        path = done_dir / f"{p}_{o}_seed{s}.json"
        if path.exists():
            runs[f"{p}_{o}"][str(s)] = json.loads(path.read_text())
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=context) as pool:
        futures = {
            pool.submit(stage_two, p, o, s, config, checkpoint, args.threads, str(done_dir / f"{p}_{o}_seed{s}.json")): (p, o, s)
            for p, o, s, config, checkpoint in jobs if str(s) not in runs[f"{p}_{o}"]
        }
        for future in as_completed(futures):
            p, o, s = futures[future]
            runs[f"{p}_{o}"][str(s)] = future.result()
            result = {k: v for k, v in runs[f"{p}_{o}"][str(s)].items() if k != "records"}
            print(f"seed {s} {p}_{o}: {json.dumps(result)}", flush=True)
    for arm, seeds in runs.items():
        base = "reflectrl" if arm.startswith("reflectrl") else "gtplus"
        for seed, run in seeds.items():
            run["stage1_wall_s"] = stage1[base, int(seed)]["wall_s"]
    runs = {arm: dict(sorted(seeds.items())) for arm, seeds in runs.items()}
    record = {
        "benchmark": "compare_reflectrl",
        "figures": summarize(runs),
        "per_seed": runs,
        "pool_summary": {k: v for k, v in json.loads(Path(f"{args.pool}.summary.json").read_text()).items() if k != "config"},
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "student_yaml": yaml.safe_load(STUDENT_YAML.read_text()),
                   "wall_s": time.perf_counter() - start},
        "machine": machine_info(),
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record["figures"], indent=2))


if __name__ == "__main__":
    main()
