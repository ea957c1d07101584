"""ReflectRL against "GT+ only" and its controls, from one expert pool, at equal RL steps (issue 34).

Every arm runs configs/examples/reflectrl_arithmetic_cpu.yaml's schedule (stage 1: SFT warm-start;
stage 2: RL on direct prompts, 80 steps) on the same GNT pool (``--pool``, e.g. the one
experiments/reflectrl_example.py wrote). Stage 1 (``STAGE_ONE``, trained once per seed, checkpointed):

- ``reflectrl``: SFT on GT+ answers + verified critiques of the GNTs by a *non-oracle* critic
  (``r3l reflect-sft --critic resolve``: the expert answers the question again);
- ``reflectrl_oracle``: the same with the oracle critic (``--critic oracle``, knows the derivation);
- ``gtplus``: SFT on the GT+ answers only (``--no_reflective``);
- ``reflectrl_equal``: ``reflectrl``'s file for more steps, so that every GT+ row is seen as often as in
  ``gtplus`` (stage 1 of ``240 x rows / GT+ rows`` steps, rounded up to the validation interval);
- ``gtplus_equal_steps``: ``gtplus``'s file for as many steps as ``reflectrl_equal`` (its compute).

Stage 2 (``ARMS``: stage 1, teacher-KL weight beta, ``model.phases.distill.teacher``): ``reflectrl`` (beta
0.05, the context-distillation teacher: the stage-1 policy with a GNT of the question in its context);
``reflectrl_beta{0,0.01,0.2}`` (the beta sweep); ``reflectrl_anchor`` (the old teacher: the stage-1
policy in the student's direct context); ``reflectrl_oracle``; ``reflectrl_equal``; ``gtplus`` (no
teacher); ``gtplus_anchor`` (GT+ only with the same KL weight, anchored to its own stage-1 policy);
``gtplus_equal_steps`` (no teacher); ``reflectrl_solution`` (``reflectrl`` with the format-matched
reflective target, ``r3l reflect-sft --target solution``: the corrected answer in the direct answers'
format, so the teacher's KL carries content, not the critique format). No ``seed_literal`` arm: that teacher restarts the student from the
pretrained M_S, and this recipe's student is a tiny policy built at random (the phase refuses it).

Before stage 2 trains, the distillation phase measures its premise (``check_teacher_premise``): the stage-1
policy's greedy success on the validation questions with their GNT in the prompt and without. Under
the arms' strict health a context-distillation arm whose teacher is not better is refused, the figures
in the refusal; otherwise they are recorded as ``teacher_premise``.

Recorded per run: validation success after stage 1 (reflective with the GNT in context, and direct:
the teacher's own figures, since the teacher is the stage-1 policy) and after stage 2 (the student,
direct), greedy and sampled, response lengths, and the logged teacher figures (``distill/kl_teacher``
at the first stage-2 step and over stage 2, ``distill/teacher_context_rate``). Validation questions
are never training questions (the recipe's ``val_disjoint``).

    nice -n 15 python -m experiments.compare_reflectrl --pool runs/reflectrl_example/pool.jsonl \
        --out benchmarks/results/compare_reflectrl_controls.json --seeds 0 1 --objectives grpo --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import yaml

ROOT = Path(__file__).resolve().parents[1]

from scripts.machine_info import machine_info
from experiments.schedule import Job, available_cores, run_jobs

STUDENT_YAML = ROOT / "configs" / "examples" / "reflectrl_arithmetic_cpu.yaml"
OBJECTIVES = {"grpo": [], "rloo": ["--config", str(ROOT / "configs" / "algorithms" / "rloo.yaml")]}
SFT_FILES = {"reflectrl": ["--critic", "resolve"], "reflectrl_oracle": ["--critic", "oracle"], "gtplus": ["--no_reflective"],
             "reflectrl_solution": ["--critic", "resolve", "--target", "solution"]}
STAGE_ONE = {"reflectrl": "reflectrl", "reflectrl_oracle": "reflectrl_oracle", "gtplus": "gtplus", "reflectrl_equal": "reflectrl",
             "gtplus_equal_steps": "gtplus", "reflectrl_solution": "reflectrl_solution"}
"""Stage-1 pipeline -> the SFT file it trains on."""
ARMS = {
    "reflectrl": ("reflectrl", 0.05, "context_distillation"),
    "reflectrl_beta0": ("reflectrl", 0.0, "context_distillation"),
    "reflectrl_beta0.01": ("reflectrl", 0.01, "context_distillation"),
    "reflectrl_beta0.2": ("reflectrl", 0.2, "context_distillation"),
    "reflectrl_anchor": ("reflectrl", 0.05, "anchor"),
    "reflectrl_oracle": ("reflectrl_oracle", 0.05, "context_distillation"),
    "reflectrl_equal": ("reflectrl_equal", 0.05, "context_distillation"),
    "reflectrl_solution": ("reflectrl_solution", 0.05, "context_distillation"),
    "gtplus": ("gtplus", 0.0, "anchor"),
    "gtplus_anchor": ("gtplus", 0.05, "anchor"),
    "gtplus_equal_steps": ("gtplus_equal_steps", 0.0, "anchor"),
}
"""Stage-2 arm -> (stage-1 pipeline, beta, teacher)."""
RL_STEPS = 80
TRACED = ("distill/kl_teacher", "distill/teacher_context_rate", "distill/teacher_param_distance")


class DistillTrace(L.Callback):
    """The teacher's per-step figures of stage 2 (``TRACED``), kept on the callback."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        figures = {name: float(metrics[name]) for name in TRACED if name in metrics}
        if figures and getattr(pl_module, "teacher", None) is not None:
            self.steps.append({"step": trainer.global_step - 1, **figures})


def sft_warmup_steps(pipeline: str, summaries: dict[str, dict], base: int, interval: int) -> int:
    """Stage-1 steps of ``pipeline``: ``base``, or for ``reflectrl_equal`` (and ``gtplus_equal_steps``) enough
    steps that each GT+ row of ``reflectrl``'s file is drawn as often as in ``gtplus`` (``base x rows / GT+
    rows``), rounded up to a multiple of ``interval``."""
    if pipeline not in ("reflectrl_equal", "gtplus_equal_steps"):
        return base
    rows = summaries["reflectrl"]["reflect_sft/rows"] / summaries["reflectrl"]["reflect_sft/gt_plus_rows"]
    return int(math.ceil(base * rows / interval) * interval)


def student_config(args: argparse.Namespace, sft: Path, logs: Path, name: str, steps: int, beta: float, teacher: str) -> dict:
    config = yaml.safe_load(STUDENT_YAML.read_text())
    config["trainer"]["logger"]["init_args"].update(save_dir=str(logs), name=name)
    config["trainer"]["max_steps"] = steps + RL_STEPS
    config["model"]["phases"]["warmstart"]["steps"] = steps
    config["data"]["suite"]["init_args"]["pool"] = str(Path(args.pool).resolve())
    config["model"]["phases"]["warmstart"]["demos"]["source"] = str(sft)
    config["model"]["phases"]["distill"].update(beta=beta, teacher=teacher)
    # Importable from the repository root, where the comparison runs (``python -m experiments.compare_reflectrl``).
    config["trainer"]["callbacks"] = [*config["trainer"].get("callbacks", []), {"class_path": "experiments.compare_reflectrl.DistillTrace"}]
    return config


def build_sft(args: argparse.Namespace, seed: int, work: Path) -> tuple[dict[str, Path], dict[str, dict]]:
    """The stage-1 SFT files of ``seed`` (``SFT_FILES``) and their summaries."""
    files, summaries = {}, {}
    for pipeline, extra in SFT_FILES.items():
        out = work / f"sft_{pipeline}_seed{seed}.jsonl"
        files[pipeline] = out
        if not Path(f"{out}.summary.json").exists():
            subprocess.run(
                [sys.executable, "-c", "from r3lightning.cli.main import main; main()", "reflect-sft", "--config", str(STUDENT_YAML),
                 "--pool", args.pool, "--out", str(out), "--seed", str(seed), *extra],
                check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
        summaries[pipeline] = {k: v for k, v in json.loads(Path(f"{out}.summary.json").read_text()).items() if k != "config"}
    return files, summaries


def _fit(config_path: Path, extra: list[str]):
    """Run ``r3l fit``; the CLI, its phase report, the module's distillation state and the trace."""
    from r3lightning.callbacks import PhaseReport
    from r3lightning.cli.main import R3LightningCLI

    cli = R3LightningCLI(args=["fit", "--config", str(config_path), "--trainer.enable_progress_bar", "false", *extra])
    report = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PhaseReport))
    trace = next(cb for cb in cli.trainer.callbacks if type(cb).__name__ == "DistillTrace")
    return cli, report, cli.model.distillation, trace


def stage_one(pipeline: str, seed: int, config_path: str, checkpoint: str, result_path: str) -> dict:
    """Train stage 1 (the warm-start, ending with the switch-step validation) and checkpoint it; the
    result is also written to ``result_path`` (by the worker: an interrupted comparison keeps it)."""
    start = time.perf_counter()
    config = yaml.safe_load(Path(config_path).read_text())
    steps = config["model"]["phases"]["warmstart"]["steps"]
    cli, _, distill, _ = _fit(Path(config_path), ["--seed_everything", str(seed), "--data.seed", str(seed), "--trainer.max_steps", str(steps)])
    cli.trainer.save_checkpoint(checkpoint)
    result = {"records": distill.records, "wall_s": time.perf_counter() - start}
    Path(result_path).write_text(json.dumps(result))
    return result


def stage_two(arm: str, objective: str, seed: int, config_path: str, checkpoint: str, result_path: str) -> dict:
    start = time.perf_counter()
    _, beta, teacher = ARMS[arm]
    config = yaml.safe_load(Path(config_path).read_text())
    rl_steps = config["trainer"]["max_steps"] - config["model"]["phases"]["warmstart"]["steps"]
    # Strict health: an arm whose switched-on component never acted, or whose update was too large, is
    # refused, not reported. The anchor arms are the exception: their teacher is the student at the switch
    # by construction (the old reading, kept as the control that shows it), which the health check calls
    # degenerate.
    strict = "false" if teacher == "anchor" else "true"
    from r3lightning.callbacks import HealthRefusal

    health = ["--health.strict", strict, "--health.after_steps", str(max(rl_steps, 1))]
    try:
        cli, report, distill, trace = _fit(
            Path(config_path),
            ["--seed_everything", str(seed), "--data.seed", str(seed), *OBJECTIVES[objective], *health, "--ckpt_path",
             checkpoint, "--resume_with", "config"],  # each arm's own algorithm and teacher over the shared stage 1
        )
    except HealthRefusal as err:
        result = {"refused": str(err), "wall_s": time.perf_counter() - start}
        Path(result_path).write_text(json.dumps(result))
        return result
    config = cli.model.phases.distill
    assert (config.beta, config.teacher) == (beta, teacher), f"{arm}: the arm's beta/teacher did not apply"
    stage1 = [r for r in distill.records if r["stage"] == 1][-1]
    stage2 = [r for r in distill.records if r["stage"] == 2][-1]
    means = report.rollout_means()
    kl = [s["distill/kl_teacher"] for s in trace.steps if "distill/kl_teacher" in s]
    context = [s["distill/teacher_context_rate"] for s in trace.steps if "distill/teacher_context_rate" in s]
    result = {
        # The teacher is the stage-1 policy: these are its own figures (reflective: a GNT in context).
        "teacher_reflective_greedy": stage1["val/success_rate_greedy"],
        "teacher_reflective_sampled": stage1["val/success_rate"],
        "teacher_direct_greedy": stage1.get("val_direct/success_rate_greedy"),
        "teacher_direct_sampled": stage1.get("val_direct/success_rate"),
        "teacher_direct_response_len": stage1.get("val_direct/response_len"),
        "student_direct_greedy": stage2["val/success_rate_greedy"],
        "student_direct_sampled": stage2["val/success_rate"],
        "student_direct_response_len_greedy": stage2.get("val/response_len_greedy"),
        "rl_rollout_response_len_mean": means.get("rollout/response_len"),
        "kl_teacher_first_step": kl[0] if kl else None,
        "kl_teacher_mean": statistics.mean(kl) if kl else None,
        "teacher_context_rate_mean": statistics.mean(context) if context else None,
        "switch_step": distill.switched_at,
        "teacher_premise": distill.premise,
        "teacher_trace": trace.steps,
        "records": distill.records,
        "wall_s": time.perf_counter() - start,
    }
    Path(result_path).write_text(json.dumps(result))
    return result


SUMMARIZED = ("teacher_reflective_greedy", "teacher_direct_greedy", "student_direct_greedy", "student_direct_sampled",
              "student_direct_response_len_greedy", "rl_rollout_response_len_mean", "kl_teacher_first_step",
              "kl_teacher_mean", "teacher_context_rate_mean")


PREMISE_REFUSAL = re.compile(
    r"answers ([\d.]+)% of (\d+) validation questions with a golden negative in its prompt and ([\d.]+)% without "
    r"\(gain ([-+\d.]+) ± ([\d.]+) points"
)
"""The figures in the distillation phase's premise refusal (``r3lightning.training.distillation``)."""


def teacher_premise_gain(run: dict) -> float | None:
    """The teacher premise's gain (success with the GNT in the prompt minus without, a fraction) of a stage-2
    run: recorded when it trained, read from the refusal when the premise stopped it; None otherwise."""
    if "refused" in run:
        found = PREMISE_REFUSAL.search(run["refused"])
        return float(found.group(4)) / 100 if found else None
    premise = run.get("teacher_premise") or {}
    return premise.get("gain")


def premise_figures(runs: dict[str, dict[str, dict]]) -> dict[str, float | dict]:
    """Per context-distillation arm, the teacher premise's gain per seed, its mean ± standard error, and
    its paired difference to ``reflectrl`` (same objective): does the arm's stage 1 give a teacher that
    knows more with a golden negative in view?"""
    gains = {arm: {s: g for s, run in seeds.items() if (g := teacher_premise_gain(run)) is not None} for arm, seeds in runs.items()}
    figures: dict[str, float | dict] = {}
    for arm, per_seed in gains.items():
        if not per_seed:
            continue
        values = list(per_seed.values())
        figures[f"{arm}/teacher_premise_gain_per_seed"] = per_seed
        figures[f"{arm}/teacher_premise_gain_mean"] = statistics.mean(values)
        figures[f"{arm}/teacher_premise_gain_se"] = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
        reference_arm = f"reflectrl_{arm.rsplit('_', 1)[1]}"
        reference = gains.get(reference_arm, {})
        paired = [per_seed[s] - reference[s] for s in per_seed if s in reference]
        if paired and arm != reference_arm:
            figures[f"{arm}/teacher_premise_gain_minus_reflectrl_mean"] = statistics.mean(paired)
            figures[f"{arm}/teacher_premise_gain_minus_reflectrl_se"] = (
                statistics.stdev(paired) / math.sqrt(len(paired)) if len(paired) > 1 else float("nan"))
    return figures


def summarize(runs: dict[str, dict[str, dict]]) -> dict[str, float]:
    """Mean and std over seeds of ``SUMMARIZED`` per arm, each arm's paired difference to ``gtplus``
    (same objective, same seeds) in student direct greedy success, and the teacher premise's gain of
    every arm that measured it, refused runs included (``premise_figures``)."""
    figures = {"refused_runs": {arm: {s: r["refused"] for s, r in seeds.items() if "refused" in r} for arm, seeds in runs.items()}}
    figures["refused_runs"] = {arm: r for arm, r in figures["refused_runs"].items() if r}
    figures.update(premise_figures(runs))
    runs = {arm: {s: r for s, r in seeds.items() if "refused" not in r} for arm, seeds in runs.items()}
    for arm, seeds in runs.items():
        for key in SUMMARIZED:
            values = [run[key] for run in seeds.values() if run.get(key) is not None]
            if values:
                figures[f"{arm}/{key}_mean"] = statistics.mean(values)
                figures[f"{arm}/{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        objective = arm.rsplit("_", 1)[1]
        baseline = runs.get(f"gtplus_{objective}", {})
        paired = [run["student_direct_greedy"] - baseline[s]["student_direct_greedy"] for s, run in seeds.items() if s in baseline]
        if paired and not arm.startswith("gtplus_" + objective):
            figures[f"{arm}/minus_gtplus_mean"] = statistics.mean(paired)
            figures[f"{arm}/minus_gtplus_se"] = statistics.stdev(paired) / math.sqrt(len(paired)) if len(paired) > 1 else float("nan")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", required=True, help="the GNT pool every seed and arm shares (r3l gnt-pool --out)")
    parser.add_argument("--out", default="benchmarks/results/compare_reflectrl_controls.json")
    parser.add_argument("--work", default="runs/compare_reflectrl", help="configs, SFT files, checkpoints and logs")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(10)), help="seeds (issue 34 asks for 10; a quick look: 2-3)")
    parser.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="stage-2 arms (default: all)")
    parser.add_argument("--cores", type=int, default=available_cores(),
                        help="cores to fill: runs (stage 1 included) go in parallel in separate processes while their "
                             "threads fit (default: the cores this process may use)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (0: torch's default, every core); the results depend on it")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = (ROOT / args.work).resolve()
    logs = work / "logs"
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = yaml.safe_load(STUDENT_YAML.read_text())
    base_steps, interval = base["model"]["phases"]["warmstart"]["steps"], base["trainer"]["val_check_interval"]
    pipelines = sorted({ARMS[arm][0] for arm in args.arms})
    configs, checkpoints, stage1, summaries = {}, {}, {}, {}
    for seed in args.seeds:
        sft, summaries[seed] = build_sft(args, seed, work)
        for pipeline in pipelines:
            steps = sft_warmup_steps(pipeline, summaries[seed], base_steps, interval)
            name = f"{pipeline}_seed{seed}"
            path = work / f"{name}.yaml"
            # Stage 1 has no teacher (beta 0); each arm's stage 2 sets its own.
            config = student_config(args, sft[STAGE_ONE[pipeline]], logs, name, steps, 0.0, "context_distillation")
            path.write_text(yaml.safe_dump(config, sort_keys=False))
            configs[pipeline, seed] = (str(path), steps)
            checkpoints[pipeline, seed] = str(work / f"{name}_stage1.ckpt")
    # Finished runs are kept in <work>/results/ and not run again, so an interrupted comparison resumes.
    done_dir = work / "results"
    done_dir.mkdir(exist_ok=True)
    for key in configs:
        path = done_dir / f"stage1_{key[0]}_seed{key[1]}.json"
        if path.exists() and Path(checkpoints[key]).exists():
            stage1[key] = json.loads(path.read_text())
    stage2 = {}
    for seed in args.seeds:
        for objective in args.objectives:
            for arm in args.arms:
                pipeline, beta, teacher = ARMS[arm]
                name = f"{arm}_{objective}_seed{seed}"
                config = student_config(args, sft_file(work, pipeline, seed), logs, name, configs[pipeline, seed][1], beta, teacher)
                path = work / f"{name}.yaml"
                path.write_text(yaml.safe_dump(config, sort_keys=False))
                stage2[arm, objective, seed] = (str(path), checkpoints[pipeline, seed])
    runs: dict[str, dict[str, dict]] = {f"{a}_{o}": {} for a, o, _ in stage2}
    for a, o, s in stage2:
        path = done_dir / f"{a}_{o}_seed{s}.json"
        if path.exists():
            runs[f"{a}_{o}"][str(s)] = json.loads(path.read_text())

    def stage_two_jobs(pipeline: str, seed: int) -> list[Job]:
        """The stage-2 runs that start from ``pipeline``'s stage 1 of ``seed`` and have no result yet."""
        return [Job(("stage2", a, o, s), stage_two, (a, o, s, *stage2[a, o, s], str(done_dir / f"{a}_{o}_seed{s}.json")),
                    threads=args.threads)
                for a, o, s in stage2 if s == seed and ARMS[a][0] == pipeline and str(s) not in runs[f"{a}_{o}"]]

    def then(job: Job, result: dict) -> list[Job]:
        kind, *key = job.key
        if kind == "stage1":
            p, s = key
            stage1[p, s] = result
            print(f"stage 1 {p} seed {s}: {json.dumps(result['records'][-1:])}", flush=True)
            return stage_two_jobs(p, s)
        a, o, s = key
        runs[f"{a}_{o}"][str(s)] = result
        shown = {k: v for k, v in result.items() if k not in ("records", "teacher_trace")}
        print(f"seed {s} {a}_{o}: {json.dumps(shown)}", flush=True)
        return []

    # Stage 1 first (every stage-2 run waits on one); a stage 2 starts once its own stage 1 is trained.
    jobs = [Job(("stage1", p, s), stage_one, (p, s, configs[p, s][0], checkpoints[p, s], str(done_dir / f"stage1_{p}_seed{s}.json")),
                threads=args.threads, priority=1)
            for p, s in configs if (p, s) not in stage1]
    jobs += [job for p, s in stage1 for job in stage_two_jobs(p, s)]
    run_jobs(jobs, args.cores, then)
    for key, seeds in runs.items():
        pipeline = ARMS[key.rsplit("_", 1)[0]][0]
        for seed, run in seeds.items():
            run["stage1_wall_s"] = stage1[pipeline, int(seed)]["wall_s"]
            run["stage1_steps"] = configs[pipeline, int(seed)][1]
    runs = {arm: dict(sorted(seeds.items())) for arm, seeds in runs.items()}
    record = {
        "benchmark": "compare_reflectrl_controls",
        "figures": summarize(runs),
        "per_seed": runs,
        "pool_summary": {k: v for k, v in json.loads(Path(f"{args.pool}.summary.json").read_text()).items() if k != "config"},
        "sft_summaries": {str(seed): summary for seed, summary in summaries.items()},
        "config": {**{k: v for k, v in vars(args).items() if k != "out"}, "arms_spec": {a: ARMS[a] for a in args.arms},
                   "student_yaml": base, "rl_steps": RL_STEPS, "wall_s": time.perf_counter() - start},
        "machine": machine_info(),
    }
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(json.dumps(record["figures"], indent=2))


def sft_file(work: Path, pipeline: str, seed: int) -> Path:
    """The SFT file ``build_sft`` wrote for ``pipeline``'s stage 1 (``STAGE_ONE``)."""
    return work / f"sft_{STAGE_ONE[pipeline]}_seed{seed}.jsonl"


if __name__ == "__main__":
    main()
