"""Nothing configured is silently inert: each case the 2026-12-02 reviews found (a component switched on
that did nothing while every run exited 0) now warns, or stops a strict run naming the component, its
figure and its key."""

from types import SimpleNamespace

import pytest
from harness import module_and_data, quiet_trainer

from r3lightning.algos.objective import AlgorithmConfig, RankingConfig
from r3lightning.callbacks import ComponentHealth, InertComponentError
from r3lightning.data.replay import ReplayConfig
from r3lightning.envs.math_env import MathSuite
from r3lightning.rollout.agent_loop import AgentLoopConfig
from r3lightning.rollout.explorers.base import SampleExplorer
from r3lightning.rollout.explorers.in_context import InContextReflectionExplorer
from r3lightning.rollout.explorers.reflect_retry import ReflectRetryExplorer


def feed(callback: ComponentHealth, steps: list[dict], explorer=None, algorithm=None, replay=None, teacher=None):
    """Run ``callback`` over RL steps whose logged scalars are ``steps``, as a fit would."""
    dm = SimpleNamespace(explorer=explorer or SampleExplorer(), replay=replay or ReplayConfig(),
                         agent=AgentLoopConfig(action_format="raw"))
    module = SimpleNamespace(algorithm=algorithm or AlgorithmConfig(), teacher=teacher, teacher_kl_coef=0.05 if teacher else 0.0)
    trainer = SimpleNamespace(datamodule=dm)
    callback.setup(trainer, module, "fit")
    for metrics in steps:
        outputs = {"metrics": {"train/phase_rl": 1.0, "rollout/generated_tokens": 10.0, **metrics}}  # training_step's return
        callback.on_train_batch_end(trainer, module, outputs, None, 0)
    callback.on_fit_end(trainer, module)
    return callback


def test_in_context_reflection_that_never_generated_stops_a_strict_run():
    steps = [{"rollout/in_context_tokens": 0.0, "rollout/in_context_episodes": 4.0}] * 3
    with pytest.raises(InertComponentError, match=r"R³ in-context reflection .* inert: rollout/in_context_tokens was 0 over 3 RL steps \(controlled by data.explorer"):
        feed(ComponentHealth(after_steps=3, strict=True), steps, explorer=InContextReflectionExplorer())


def test_success_judgments_that_never_fire_are_named_with_their_key():
    steps = [{"rollout/retry_rate": 0.9, "rollout/reflection_invalid_rate": 0.2, "rollout/success_judgment_samples": 0.0}] * 4
    with pytest.warns(UserWarning, match=r"R³L success judgments .* rollout/success_judgment_samples was 0 .*train_success_judgments"):
        health = feed(ComponentHealth(after_steps=4), steps, explorer=ReflectRetryExplorer())
    assert len(health.findings) == 1


def test_all_invalid_reflections_are_degenerate():
    steps = [{"rollout/retry_rate": 0.1, "rollout/reflection_invalid_rate": 1.0, "rollout/success_judgment_samples": 1.0}] * 2
    with pytest.raises(InertComponentError, match=r"R³L reflect-then-retry is degenerate: rollout/reflection_invalid_rate = 1 .*retry\)"):
        feed(ComponentHealth(after_steps=2, strict=True), steps, explorer=ReflectRetryExplorer())


def test_a_teacher_identical_to_the_student_is_degenerate():
    steps = [{"distill/kl_teacher": 0.0}, {"distill/kl_teacher": 1e-4}, {"distill/kl_teacher": 2e-4}]
    with pytest.raises(InertComponentError, match=r"ReflectRL teacher KL is degenerate: distill/kl_teacher = 0 \(first .*identical"):
        feed(ComponentHealth(after_steps=3, strict=True), steps, teacher=object())
    # a teacher that knows something the student does not: KL from the first distillation step
    assert feed(ComponentHealth(after_steps=3, strict=True), [{"distill/kl_teacher": 0.3}] * 3, teacher=object()).findings == []


def test_a_ranking_bonus_that_follows_length_is_degenerate():
    ranking = AlgorithmConfig(ranking=RankingConfig(enabled=True))
    steps = [{"activity/ranked_failures": 12.0, "activity/ranking_length_corr": -0.99}] * 3
    with pytest.raises(InertComponentError, match=r"ranking of failures is degenerate: activity/ranking_length_corr = 0.99.*ranking.enabled"):
        feed(ComponentHealth(after_steps=3, strict=True), steps, algorithm=ranking)
    steps = [{"activity/ranked_failures": 12.0, "activity/ranking_length_corr": c} for c in (0.4, -0.3, 0.1)]
    assert feed(ComponentHealth(after_steps=3, strict=True), steps, algorithm=ranking).findings == []


def test_a_short_run_is_judged_at_its_end_and_steps_before_rl_do_not_count():
    callback = ComponentHealth(after_steps=50)
    with pytest.warns(UserWarning, match="replay/injected was 0 over 2 RL steps"):
        feed(callback, [{"replay/injected": 0.0}] * 2, replay=ReplayConfig(enabled=True))


def test_answers_refused_by_format_are_refused_at_setup_or_stop_a_strict_run():
    """A math suite with the tag action format: every answer "Invalid action format", reward 0, as a new
    user saw with an own JSONL. The suite's declared answer format refuses it before step 0; a format that
    still refuses nearly every action at run time (a suite that declares none) stops a strict run."""
    with pytest.raises(ValueError, match=r"data.agent.action_format is 'tag' but data.suite \(MathSuite\) answers in 'raw'"):
        module_and_data(MathSuite(source="arithmetic", num_val_tasks=2, instruction=""),
                        agent=AgentLoopConfig(action_format="tag", max_context_tokens=128))
    steps = [{"rollout/invalid_action_rate": 1.0}, {"rollout/invalid_action_rate": 0.97}]
    with pytest.raises(InertComponentError, match=r"action parser \('raw'\) is degenerate: rollout/invalid_action_rate = 0.985 .*data.agent.action_format"):
        feed(ComponentHealth(after_steps=2, strict=True), steps)


def test_in_context_reflection_in_a_run_without_failure_streaks_warns():
    """In a real tiny run whose tasks never fail twice in a row, in-context reflection never shows a past
    attempt: it is named as inert."""
    module, dm = module_and_data(explorer=InContextReflectionExplorer(after_failures=30), agent=AgentLoopConfig(action_format="raw", max_context_tokens=192))
    health = ComponentHealth(after_steps=2)
    with pytest.warns(UserWarning, match="R³ in-context reflection is switched on but inert"):
        quiet_trainer(2, callbacks=[health]).fit(module, dm)


def test_meta_tasks_as_positive_samples_that_never_come_are_named_and_the_idle_sft_head_is_not():
    """Meta-tasks trained as +1 RL samples (the reference code's reading) are judged on the samples the
    explorer made (``rollout/meta_task_samples``), not on SFT rows, which that reading never has."""
    pooled = AlgorithmConfig(meta_tasks_as="positive_samples", sft_weight=0.0)
    explorer = ReflectRetryExplorer(train_success_judgments=False)
    busy = {"rollout/retry_rate": 0.9, "rollout/reflection_invalid_rate": 0.2, "activity/sft_rows": 0.0}
    feed(ComponentHealth(after_steps=2, strict=True), [{**busy, "rollout/meta_task_samples": 2.0}] * 2,
         explorer=explorer, algorithm=pooled)
    with pytest.raises(InertComponentError, match=r"R³L meta-tasks as \+1 RL samples .* rollout/meta_task_samples was 0 .*meta_tasks_as"):
        feed(ComponentHealth(after_steps=2, strict=True), [{**busy, "rollout/meta_task_samples": 0.0}] * 2,
             explorer=explorer, algorithm=pooled)
    # With the SFT head, its rows are what must be seen.
    with pytest.raises(InertComponentError, match=r"R³L meta-task SFT .* activity/sft_rows was 0"):
        feed(ComponentHealth(after_steps=2, strict=True), [{**busy, "rollout/meta_task_samples": 2.0}] * 2,
             explorer=explorer, algorithm=AlgorithmConfig(sft_weight=1.0))
