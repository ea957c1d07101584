"""Report validation success at the end of the SFT warm-up and at the end of training, write each
validation as JSON and a markdown table, and the run's progress as a PNG."""

from __future__ import annotations

import json
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L
import torch

from r3lightning.callbacks.monitor import log_dir_of
from r3lightning.data.state_checks import expect_int, expect_number, expect_type
from r3lightning.types import step_output


ROLLOUT_FIGURES = (
    "rollout/retry_improvement_rate",
    "rollout/reflection_invalid_rate",
    "rollout/retry_rate",
    "rollout/reflection_outcome_agreement",
)
"""Printed at the end of fit as percentages (means over RL steps)."""

RECORDED_FIGURES = (
    "rollout/generated_tokens",
    "rollout/response_len",
    "rollout/pivot_late_share",
    "rollout/pivot_accuracy",
    "rollout/pivot_offset",
    "rollout/retry_tokens_saved_share",
    "rollout/replay_failures",
    "rollout/success_judgment_samples",
    "rollout/meta_task_samples",
    "train/zero_variance_group_rate",
    "train/zero_variance_group_rate_before_replay",
    "replay/rescued_group_rate",
    "activity/ranking_bonus_abs_mean",
    "activity/ranked_failures",
    "activity/ranking_length_corr",
    "activity/ranking_credit_corr",
    "activity/ranking_credit_samples",
    "activity/sft_rows",
    "activity/amplified_rows",
    "activity/pivot_masked_rows",
    "rollout/in_context_task_rate",
    "rollout/in_context_episodes",
    "rollout/in_context_tokens",
    "rollout/in_context_unplayed",
    "rollout/in_context_success_rate",
    "rollout/in_context_plain_success_rate",
    "replay/injected",
    "rollout/invalid_action_rate",
    # R³L's premise gates (issue 62): the policy gradient's variance, the policy's entropy on RL tokens
    # (RL steps only: ``train/entropy`` also averages the warm-start's, whose sums a resumed run inherits)
    "train/policy_grad_var",
    "train/policy_grad_var_rel",
    "train/policy_grad_chunks",
    "train/entropy_rl",
    "reward/success_rate",
)
"""Also averaged over RL steps into ``phase_report.json`` (what a method spent, where its pivots fell)."""


PLOT_FILE = "progress.png"
"""Written next to the TensorBoard logs at the end of ``fit`` (needs matplotlib)."""


@dataclass
class SeedSpread:
    """A recipe's validation success measured over several runs (seeds, thread counts, machines), printed
    beside a run's own figures so that a user can tell a normal draw from a broken run. Fractions in
    [0, 1], one per run.

    Args:
        before_training_greedy: greedy validation success of the model as loaded, per run.
        after_warmup_greedy: greedy validation success after the warm-start, per run.
        after_rl_greedy: greedy validation success at the end of the run, per run, in the same order.
        source: where they were measured (the document, the seeds, the thread counts, the machines).
        final_step: the step of the runs' last validation (``after_rl_greedy``); a run that ends at
            another step is not compared with the warm-start and RL figures.
        algorithm: ``model.algorithm`` fields of the runs (nested ones as mappings, e.g. ``ranking:
            {enabled: false}``); a run whose values differ (another method stacked on the recipe) is not
            compared with the warm-start and RL figures.
        explorer: the class name of the runs' explorer (``data.explorer``), compared the same way.
        explorer_args: attributes of the runs' explorer by dotted path (``reflector.source: policy``),
            compared the same way.
    """

    before_training_greedy: list[float] = field(default_factory=list)
    after_warmup_greedy: list[float] = field(default_factory=list)
    after_rl_greedy: list[float] = field(default_factory=list)
    source: str = ""
    final_step: Optional[int] = None
    algorithm: dict[str, Any] = field(default_factory=dict)
    explorer: str = ""
    explorer_args: dict[str, Any] = field(default_factory=dict)


def dotted(value: Any, path: str) -> Any:
    """``value.a.b`` for ``path`` ``"a.b"`` (None where an attribute is missing)."""
    for name in path.split("."):
        value = getattr(value, name, None)
    return value


def spread_differences(spread: SeedSpread, final_step: Optional[int], algorithm: Any, explorer: Any) -> list[str]:
    """What sets this run apart from the runs ``spread`` measured (empty: the same recipe, as far as the
    spread says): its last step, the ``algorithm`` fields the spread names, its explorer's class and the
    explorer attributes the spread names."""
    differences = []
    if spread.final_step is not None and final_step != spread.final_step:
        differences.append(f"ends at step {final_step}, not {spread.final_step}")
    for name, expected in spread.algorithm.items():
        actual = getattr(algorithm, name, None)
        pairs = ([(f"{name}.{k}", v, getattr(actual, k, None)) for k, v in expected.items()]
                 if isinstance(expected, dict) else [(name, expected, actual)])
        differences += [f"model.algorithm.{key} is {got!r}, not {want!r}" for key, want, got in pairs if got != want]
    if spread.explorer and type(explorer).__name__ != spread.explorer:
        differences.append(f"explorer {type(explorer).__name__}, not {spread.explorer}")
    differences += [f"explorer {path} is {dotted(explorer, path)!r}, not {want!r}"
                    for path, want in spread.explorer_args.items() if dotted(explorer, path) != want]
    return differences


def spread_text(values: list[float]) -> str:
    """``"27.1% ± 3.2 over 3 runs (24.0-30.5)"``: mean, sample standard deviation and range, in percent."""
    if not values:
        return ""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return (f"{100 * statistics.mean(values):.1f}% ± {100 * std:.1f} over {len(values)} runs "
            f"({100 * min(values):.1f}-{100 * max(values):.1f})")


class PhaseReport(L.Callback):
    """Collects ``val/*`` after every validation, tagged with the phase, and prints a summary.

    Each validation (of ``fit`` or ``r3l validate``) is also written, on rank 0, as
    ``<log_dir>/validation_step<N>.json`` and ``.md``: the suite, the number of tasks and samples per
    task, the sampling settings and every ``val/*`` figure (greedy pass@1, pass@k, mean@n, reward,
    response length, truncation), the markdown as a table.

    With ``trainer.num_sanity_val_steps: -1`` Lightning's sanity check validates the whole set before
    the first step; that validation is kept as the model ``before training`` (step 0, phase
    ``initial``), logged at step 0, and printed first.

    At the end of ``fit`` the summary names the last validation of the warm-up phase (the one run at
    the step where RL begins) and the last validation overall, plus the mean over RL steps of the
    explorer's reflect-then-retry figures (``ROLLOUT_FIGURES``, when the explorer logs them), and is
    written to ``<log_dir>/phase_report.json``; ``<log_dir>/progress.png`` plots validation success
    (greedy and sampled) and ``reward/mean`` over steps (skipped, with a one-line note, without
    matplotlib). The printed summary says where these files are.

    Args:
        seed_spread: the recipe's greedy success over several seeds (``SeedSpread``), printed beside
            this run's figures; a recipe that has been measured so (``configs/quickstart.yaml``) sets it.
    """

    def __init__(self, seed_spread: Optional[SeedSpread] = None) -> None:
        self.seed_spread = seed_spread
        self.records: list[dict[str, Any]] = []
        self.rollout_sums: dict[str, float] = {}
        self.rollout_steps: dict[str, int] = {}
        self.reward_history: list[tuple[int, float]] = []
        self._val_tasks = 0
        self._checkpoint_step: Optional[int] = None
        self.last_validation_file: Optional[str] = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        # The step's own scalars: ``trainer.callback_metrics`` keeps stale values of tags a step did not log.
        metrics = step_output(outputs)["metrics"]
        for name in ROLLOUT_FIGURES + RECORDED_FIGURES:
            if name in metrics:
                self.rollout_sums[name] = self.rollout_sums.get(name, 0.0) + float(metrics[name])
                self.rollout_steps[name] = self.rollout_steps.get(name, 0) + 1
        if "reward/mean" in metrics:
            self.reward_history.append((int(trainer.global_step), float(metrics["reward/mean"])))

    def rollout_means(self) -> dict[str, float]:
        return {name: self.rollout_sums[name] / self.rollout_steps[name] for name in self.rollout_sums}

    # ---- validation ---------------------------------------------------------------------------
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        # ``r3l validate --ckpt_path`` restores the weights but not the loops: name its files by the
        # checkpoint's step rather than the trainer's 0.
        self._checkpoint_step = checkpoint.get("global_step")

    def _step(self, trainer: L.Trainer) -> int:
        if not _fitting(trainer) and self._checkpoint_step is not None:
            return int(self._checkpoint_step)
        return int(trainer.global_step)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_tasks = 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx: int = 0) -> None:
        self._val_tasks += len(getattr(batch, "tasks", ()))

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.world_size > 1:  # every rank runs this hook: the sum is collective
            count = torch.tensor(float(self._val_tasks), device=pl_module.device)
            self._val_tasks = int(trainer.strategy.reduce(count, reduce_op="sum"))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if getattr(pl_module, "skips_validation", False):
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if trainer.sanity_checking:
            if not _whole_sanity_check(trainer) or trainer.global_step > 0 or not metrics:
                return
            # The model as it starts: Lightning neither logs nor keeps a sanity check's figures.
            phase = "initial"
            if trainer.logger is not None:
                trainer.logger.log_metrics(metrics, step=0)
        else:
            # The phase the validation measures: the one whose last step ran before it.
            phase = pl_module.phases.before(self._step(trainer)).name
        self.records.append({"step": self._step(trainer), "phase": phase, **metrics})
        if trainer.is_global_zero:
            self.last_validation_file = self.write_validation(trainer, self.records[-1])
            if not _fitting(trainer):
                print(f"[r3lightning] validation figures: {self.last_validation_file} (and .md)", flush=True)

    def write_validation(self, trainer: L.Trainer, record: dict[str, Any]) -> str:
        """Write ``record`` as ``<log_dir>/validation_step<N>.json`` and ``.md``; returns the JSON's path."""
        dm = getattr(trainer, "datamodule", None)
        sampling = getattr(dm, "val_sampling", None)
        report = {
            "step": record["step"],
            "phase": record["phase"],
            "suite": type(dm.suite).__name__ if dm is not None and hasattr(dm, "suite") else None,
            "tasks": self._val_tasks,
            "samples_per_task": getattr(dm, "val_samples", 1),
            "val_sampling": (
                {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_new_tokens": sampling.max_new_tokens}
                if sampling is not None
                else None
            ),
            "metrics": {k: v for k, v in record.items() if k.startswith("val/")},
        }
        log_dir = log_dir_of(trainer)
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, f"validation_step{record['step']}.json")
        with open(path, "w") as handle:
            json.dump(report, handle, indent=2)
        with open(path[: -len(".json")] + ".md", "w") as handle:
            handle.write(validation_markdown(report))
        return path

    # ---- end of fit --------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        warmup = [r for r in self.records if r["phase"] == "warmstart"]
        initial = [r for r in self.records if r["phase"] == "initial"]
        return {
            "before_training": initial[0] if initial else None,
            "after_warmup": warmup[-1] if warmup else None,
            "final": self.records[-1] if self.records else None,
            "rl_rollout_means": self.rollout_means(),
            "history": self.records,
            "reward_history": [list(point) for point in self.reward_history],
        }

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero or not self.records:
            return
        summary = self.summary()
        log_dir = log_dir_of(trainer)
        os.makedirs(log_dir, exist_ok=True)
        report_path = os.path.join(log_dir, "phase_report.json")
        with open(report_path, "w") as handle:
            json.dump(summary, handle, indent=2)
        plot_path, plot_note = os.path.join(log_dir, PLOT_FILE), None
        try:
            plot_progress(self.records, self.reward_history, plot_path)
        except ImportError:
            plot_path, plot_note = None, "progress plot skipped: matplotlib is not installed (pip install matplotlib)"
        lines = ["[r3lightning] validation success rate (greedy / sampled):"]
        spread = self.seed_spread or SeedSpread()
        explorer = getattr(getattr(pl_module, "datamodule", None), "explorer", None)
        final_step = summary["final"]["step"] if summary["final"] else None
        differences = spread_differences(spread, final_step, getattr(pl_module, "algorithm", None), explorer)
        trained = {} if differences else {"after warm-start": spread.after_warmup_greedy, "after RL": spread.after_rl_greedy}
        for label, record, known in (
            ("before training", summary["before_training"], spread.before_training_greedy),
            ("after warm-start", summary["after_warmup"], trained.get("after warm-start")),
            ("after RL", summary["final"], trained.get("after RL")),
        ):
            if record is not None:
                lines.append(
                    f"  {label:<17} step {record['step']:>5}: "
                    f"{100 * record.get('val/success_rate_greedy', float('nan')):5.1f}% / "
                    f"{100 * record.get('val/success_rate', float('nan')):5.1f}%"
                    + (f"   (this recipe, greedy: {spread_text(known)})" if known else "")
                )
        if spread.source and (spread.before_training_greedy or spread.after_warmup_greedy or spread.after_rl_greedy):
            lines.append(f"  seed spread measured in {spread.source}")
        if differences and (spread.after_warmup_greedy or spread.after_rl_greedy):
            lines.append("  the recipe's trained spread is not shown: this run is not the recipe it measured ("
                         + "; ".join(differences) + ")")
        for name, value in summary["rl_rollout_means"].items():
            if name in ROLLOUT_FIGURES:
                lines.append(f"  {name} (mean over {self.rollout_steps[name]} RL steps): {100 * value:.1f}%")
        if self.last_validation_file is not None:
            lines.append(f"  last validation: {self.last_validation_file} (and .md)")
        lines.append(f"  summary: {report_path}")
        checkpoint = next((c.last_model_path for c in getattr(trainer, "callbacks", []) if getattr(c, "last_model_path", "")), None)
        if checkpoint:  # what a user resumes from (--ckpt_path last) or exports (r3l export --ckpt_path)
            lines.append(f"  last checkpoint: {checkpoint}")
        lines.append(f"  progress plot: {plot_path}" if plot_path else f"  {plot_note}")
        print("\n".join(lines), flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "rollout_sums": self.rollout_sums,
            "rollout_steps": self.rollout_steps,
            "reward_history": [list(point) for point in self.reward_history],
        }

    @staticmethod
    def check_state_dict(state: dict[str, Any]) -> None:
        """``ValueError("<field>: <problem>")`` for a damaged state (checked before any is restored)."""
        expect_type(state.get("records", []), list, "records")
        expect_type(state.get("rollout_sums", {}), dict, "rollout_sums")
        expect_type(state.get("rollout_steps", {}), dict, "rollout_steps")
        history = state.get("reward_history", [])
        expect_type(history, list, "reward_history")
        for index, point in enumerate(history):
            if not isinstance(point, (list, tuple)) or len(point) != 2:
                raise ValueError(f"reward_history[{index}]: {point!r} is not a (step, reward) pair")
            expect_int(point[0], f"reward_history[{index}] step", minimum=None)
            expect_number(point[1], f"reward_history[{index}] reward")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = list(state_dict.get("records", []))
        self.rollout_sums = dict(state_dict.get("rollout_sums", {}))
        self.rollout_steps = dict(state_dict.get("rollout_steps", {}))
        self.reward_history = [(int(step), float(value)) for step, value in state_dict.get("reward_history", [])]


# ---- files ---------------------------------------------------------------------------------------
def _whole_sanity_check(trainer: L.Trainer) -> bool:
    """Whether Lightning's sanity check runs every validation batch (``trainer.num_sanity_val_steps: -1``),
    so that its figures are a full validation of the model before its first step."""
    batches = getattr(trainer, "num_val_batches", None) or []
    return bool(batches) and all(n <= trainer.num_sanity_val_steps for n in batches)


def _fitting(trainer: L.Trainer) -> bool:
    state = getattr(trainer, "state", None)
    return state is None or state.fn == "fit"


def _pass_k(name: str) -> int:
    return int(name.split("@", 1)[1])


def validation_markdown(report: dict[str, Any]) -> str:
    """A validation report (``PhaseReport.write_validation``) as a markdown table, one row per suite."""
    metrics = report["metrics"]
    passes = sorted((k for k in metrics if re.fullmatch(r"val/pass@\d+", k)), key=_pass_k)
    means = [k for k in metrics if re.fullmatch(r"val/mean@\d+", k)]
    percent = lambda key: f"{100 * metrics[key]:.1f}%" if key in metrics else "-"  # noqa: E731
    number = lambda key, fmt: format(metrics[key], fmt) if key in metrics else "-"  # noqa: E731
    columns = [("greedy pass@1", percent("val/success_rate_greedy"))]
    columns += [(k.split("/", 1)[1], percent(k)) for k in passes + means]
    columns += [
        ("reward (sampled)", number("val/reward_mean", ".3f")),
        ("response len greedy / sampled", f"{number('val/response_len_greedy', '.1f')} / {number('val/response_len', '.1f')}"),
        ("truncated greedy / sampled", f"{percent('val/truncated_rate_greedy')} / {percent('val/truncated_rate')}"),
    ]
    sampling = report.get("val_sampling") or {}
    samples = report.get("samples_per_task", 1)
    lines = [
        f"# Validation at step {report['step']} ({report['phase']})",
        "",
        f"{report.get('tasks', '?')} tasks: one greedy episode each, and {samples} sampled "
        f"episode{'s' if samples != 1 else ''} each at temperature {sampling.get('temperature', '?')}, top_p "
        f"{sampling.get('top_p', '?')}. pass@k is the unbiased estimator over the sampled episodes, mean@{samples} "
        "their mean success.",
        "",
        "| suite | " + " | ".join(name for name, _ in columns) + " |",
        "| --- | " + " | ".join("---:" for _ in columns) + " |",
        f"| {report.get('suite') or '-'} | " + " | ".join(value for _, value in columns) + " |",
        "",
    ]
    return "\n".join(lines)


def plot_progress(records: list[dict[str, Any]], reward_history: list[tuple[int, float]], path: str) -> None:
    """Validation success (greedy and sampled) and ``reward/mean`` over steps, as a PNG at ``path``.
    Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display backend
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(10, 3.6), layout="constrained")
    val_axes, reward_axes = figure.subplots(1, 2)
    passes = sorted({k for r in records for k in r if re.fullmatch(r"val/pass@\d+", k)}, key=_pass_k)
    curves = [("val/success_rate_greedy", "greedy"), ("val/success_rate", "sampled")]
    if passes and _pass_k(passes[-1]) > 1:
        curves.append((passes[-1], f"sampled, {passes[-1].split('/', 1)[1]}"))
    for key, label in curves:
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            steps, values = zip(*points)
            val_axes.plot(steps, values, marker="o", label=label)
    val_axes.set(title="validation success rate", xlabel="step", ylim=(-0.02, 1.02))
    if val_axes.lines:
        val_axes.legend()
    if reward_history:
        steps, values = zip(*reward_history)
        reward_axes.plot(steps, values, color="tab:green", marker="o" if len(steps) < 30 else None, markersize=3)
    reward_axes.set(title="reward/mean (training rollouts)", xlabel="step")
    for axes in (val_axes, reward_axes):
        axes.grid(alpha=0.3)
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.savefig(path, dpi=100)
