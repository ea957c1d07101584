"""TrainingDynamicsMonitor and RolloutSampleLogger: the tags they log and the samples they write."""

import json
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from digit_suite import DigitSuite
from harness import module_and_data, quiet_trainer
from lightning.pytorch.loggers import TensorBoardLogger

from r3lightning.callbacks.monitor import RolloutSampleLogger, TrainingDynamicsMonitor, pick_samples
from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.types import Trajectory, Turn


def event_scalars_and_texts(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events.Tags()["scalars"], events.Tags()["tensors"]


class Expected(L.Callback):
    """Recomputes the monitor's KL values from the step's experience, independently."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        e = outputs["experience"]
        m = trainer.callback_metrics
        if e.ref_logprobs is None:  # SFT warm-up step: no reference log-probs, no KL logged
            assert "train/kl_k1" not in m
            self.rows.append(dict(version=float(m["sync/weight_version"])))
            return
        mask = e.loss_mask[:, 1:]
        d = e.old_logprobs[:, 1:] - e.ref_logprobs[:, 1:]
        k1 = float((d * mask).sum() / mask.sum())
        k3 = float(((torch.exp(-d) + d - 1) * mask).sum() / mask.sum())
        self.rows.append(
            dict(
                k1=k1, k3=k3, got_k1=float(m["train/kl_k1"]), got_k3=float(m["train/kl_k3"]),
                tokens=float(mask.sum()), got_tokens=float(m["train/rl_tokens_all_ranks"]),
                version=float(m["sync/weight_version"]), step_s=float(m["time/step_s"]),
            )
        )


def test_monitor_and_sample_logger_write_tags_text_and_jsonl(tmp_path):
    # Digit rewards are mixed from the start, so the first RL update moves the policy off the reference.
    module, dm = module_and_data(
        DigitSuite(),
        algorithm=AlgorithmConfig(policy_loss="ppo_clip", kl_coef=0.05, kl_estimator="k3"),
        lr=3e-3,
        sft_steps=1,
    )
    expected = Expected()
    logger = TensorBoardLogger(str(tmp_path), name="run")
    trainer = quiet_trainer(
        3, logger=logger, log_every_n_steps=1,
        callbacks=[TrainingDynamicsMonitor(), RolloutSampleLogger(every_n_steps=2, num_samples=3), expected],
    )
    trainer.fit(module, dm)

    assert [r["version"] for r in expected.rows] == [0.0, 1.0, 2.0]
    for row in expected.rows[1:]:
        assert row["got_k1"] == pytest.approx(row["k1"], rel=1e-4, abs=1e-6)
        assert row["got_k3"] == pytest.approx(row["k3"], rel=1e-4, abs=1e-6)
        assert row["got_k3"] >= 0.0 and row["step_s"] > 0.0
        assert row["got_tokens"] == row["tokens"] > 0
    # The reference is the warm-started policy, taken at the first RL step (rolled out by that very
    # policy: no KL yet); the RL update of that step moved the policy away from it.
    assert expected.rows[1]["got_k1"] == pytest.approx(0.0, abs=1e-6) and expected.rows[1]["got_k3"] == pytest.approx(0.0, abs=1e-6)
    assert expected.rows[2]["got_k3"] > 1e-4

    scalars, tensors = event_scalars_and_texts(logger.log_dir)
    for tag in ("train/kl_k1", "train/kl_k3", "train/kl_ref", "sync/weight_version", "time/step_s", "train/rl_tokens_all_ranks", "reward/mean"):
        assert tag in scalars, tag
    assert "reward/mean_all_ranks" not in scalars  # only with several ranks
    assert any(t.startswith("samples/rollouts") for t in tensors), tensors

    rows = [json.loads(line) for line in open(f"{logger.log_dir}/rollout_samples.jsonl")]
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 2]  # the first step (2 demos), then every 2nd
    for row in rows:
        assert row["origin"] == ("demo" if row["step"] == 1 else "base") and row["turns"] and "Say a number" in row["turns"][0]["context"]
        assert row["turns"][0]["context"].startswith("<|im_start|>system")
        assert set(row) >= {"task_id", "reward", "success", "truncated", "pivot", "info", "model_version"}
        assert row["end_reason"] in ("done", "length", "context_limit")


def test_sample_logger_writes_nothing_without_a_logger(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = SimpleNamespace(global_step=1, is_global_zero=True, loggers=[], log_dir=None, default_root_dir=str(tmp_path))
    module = SimpleNamespace(tokenizer=None)
    RolloutSampleLogger(every_n_steps=1).on_train_batch_end(trainer, module, {"trajectories": [Trajectory("t", [])]}, None, 0)
    assert list(tmp_path.iterdir()) == []


def test_pick_samples_round_robin_over_origins_and_info_text():
    trajs = [Trajectory(f"t{i}", [], origin=o) for i, o in enumerate(["base", "base", "base", "distilled", "reflect_sft"])]
    assert [t.origin for t in pick_samples(trajs, 4)] == ["base", "distilled", "reflect_sft", "base"]
    assert len(pick_samples(trajs, 10)) == 5

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    traj = Trajectory(
        "t", [Turn([1, 2], [3], feedback="Incorrect.")], reward=0.5, pivot=0, origin="distilled",
        info={"reflection": {"outcome": "failure", "analysis": "x" * 50}, "token_ids": [1, 2], "guidance": "do y"},
    )
    record = RolloutSampleLogger(max_chars=20).record(traj, Tok(), step=7)
    assert record["turns"][0] == {"context": "1 2", "response": "3", "action": "", "feedback": "Incorrect.", "response_tokens": 1, "trainable": True}
    assert record["pivot"] == 0 and record["info"]["guidance"] == "do y" and "token_ids" not in record["info"]
    assert "characters cut" in record["info"]["reflection"]["analysis"]


def test_the_weight_version_is_left_to_the_weight_sync_callback_by_its_class_not_its_name():
    """``sync/weight_version`` is the monitor's unless a ``VLLMWeightSync`` (a subclass too) logs it; a
    foreign callback that merely shares the name does not silence it."""
    from r3lightning.callbacks.vllm_sync import VLLMWeightSync

    class TunedSync(VLLMWeightSync):
        pass

    namesake = type("VLLMWeightSync", (L.Callback,), {})()
    for others, logs in (([], True), ([TunedSync()], False), ([VLLMWeightSync()], False), ([namesake], True)):
        monitor = TrainingDynamicsMonitor()
        monitor.setup(SimpleNamespace(callbacks=[monitor, *others]), None, "fit")
        assert monitor._log_weight_version is logs, others
