"""The update-size guard (``health.update_kl_max``): the KL from the policy that sampled a step to the
updated one, on the step's own tokens, is 0 for an unchanged policy, grows with the update, and a
learning rate that wrecks the model in one step is reported (strict: the run stops before the next step)
while the own-task page's settings are not."""

import csv
import sys

import pytest
import torch
from test_own_task import page_files

from r3lightning.callbacks.update_size import update_kl
from r3lightning.types import ExperienceBatch


class Bigram(torch.nn.Module):
    """A policy whose next-token logits depend on the current token only."""

    def __init__(self, vocab: int = 7) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids, attention_mask=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


def experience_of(policy, temperature=1.0) -> ExperienceBatch:
    ids = torch.tensor([[1, 2, 3, 4, 5], [2, 3, 1, 0, 0]])
    with torch.no_grad():
        logp = torch.log_softmax(policy(ids).logits[:, :-1] / temperature, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    old = torch.cat([torch.zeros(2, 1), logp], dim=1)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    zeros = torch.zeros(2, 5)
    return ExperienceBatch(input_ids=ids, attention_mask=(ids > 0) | (torch.arange(5) < 3), loss_mask=mask, sft_mask=zeros,
                           turn_index=zeros, advantages=zeros, old_logprobs=old, rewards=torch.zeros(2), temperature=temperature)


def test_the_kl_is_zero_for_the_policy_that_sampled_and_the_estimator_on_the_loss_tokens_otherwise():
    policy = Bigram()
    experience = experience_of(policy, temperature=0.7)
    assert update_kl(policy, experience, 8) == (pytest.approx(0.0, abs=1e-7), 5)
    with torch.no_grad():
        policy.table[2] += torch.tensor([0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0])
    new = torch.log_softmax(policy.table.detach() / 0.7, dim=-1)
    tokens = [(2, 3), (3, 4), (4, 5), (2, 3), (3, 1)]  # (current, next) at the loss positions
    log_ratio = torch.tensor([float(new[a, b]) for a, b in tokens]) - experience.old_logprobs[experience.loss_mask.bool()]
    expected = float((log_ratio.exp() - 1 - log_ratio).mean())
    kl, count = update_kl(policy, experience, 8)
    assert count == 5 and kl == pytest.approx(expected) and kl > 0.01
    assert update_kl(policy, experience, 1)[1] == 3  # only the first RL row
    experience.behaviour = ["pinned", "pinned"]
    assert update_kl(policy, experience, 8) is None  # no behaviour log-probs to compare with


def _own_task_fit(tmp_path, monkeypatch, *extra):
    from r3lightning.cli.main import main

    for name, text in page_files().items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_reward", raising=False)
    monkeypatch.setattr(sys, "argv", ["r3l", "fit", "--config", "own_task.yaml", "--trainer.limit_val_batches", "0", *extra])
    main()


def _logged_update_kl(tmp_path) -> list[float]:
    with open(tmp_path / "runs" / "own_task" / "version_0" / "metrics.csv") as handle:
        return [float(row["health/update_kl"]) for row in csv.DictReader(handle) if row.get("health/update_kl")]


def test_the_own_task_page_settings_make_small_updates_and_no_report(tmp_path, monkeypatch, capsys):
    _own_task_fit(tmp_path, monkeypatch, "--trainer.max_steps", "3", "--health.strict", "true")
    kls = _logged_update_kl(tmp_path)
    assert len(kls) == 3 and 0 < max(kls) < 0.1
    assert "update_kl_max" not in capsys.readouterr().err


def test_a_learning_rate_that_wrecks_the_model_in_one_update_stops_a_strict_run_before_the_next_step(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        _own_task_fit(tmp_path, monkeypatch, "--trainer.max_steps", "5", "--model.optim.lr", "0.5", "--health.strict", "true")
    err = capsys.readouterr().err
    assert stop.value.code == 1
    assert "health.strict: health: RL step 1 moved the policy by KL " in err
    assert "above health.update_kl_max=1; an update this large usually wrecks a pretrained model. The learning rate was 0.5" in err
    assert "lower model.optim.lr (1e-6 to 1e-5 suits a pretrained model)" in err
    assert len(_logged_update_kl(tmp_path)) <= 1  # no second step ran


def test_a_too_large_update_is_a_health_refusal_that_comparisons_record_as_refused():
    # experiments/compare_algorithms.py and compare_reflectrl.py record an arm that raises HealthRefusal as
    # refused; before, an oversized update escaped them and stopped the whole comparison.
    from r3lightning.callbacks import HealthRefusal, InertComponentError, UpdateSizeError

    assert issubclass(UpdateSizeError, HealthRefusal) and issubclass(InertComponentError, HealthRefusal)
    for module in ("experiments.compare_algorithms", "experiments.compare_reflectrl"):
        source = __import__("importlib").util.find_spec(module).origin
        assert "except HealthRefusal" in open(source).read()
