"""``log_grad_variance``: the variance of the policy loss's gradient across a step's micro-batches (the
premise of R³L's pivotal credit, issue 62) is logged without changing the update, and matches the
micro-batch gradients computed apart; ``train/entropy_rl`` is the policy's entropy on its RL tokens."""

import math

import torch
from digit_suite import DigitSuite
from harness import LastStep, module_and_data, quiet_trainer

from r3lightning.algos.objective import AlgorithmConfig
from r3lightning.algos.premise import gradient_variance


def one_step(log_grad_variance, micro_batch_size):
    """One training step: the module, each micro-batch's policy-loss gradient and the step's logged scalars."""
    torch.manual_seed(0)
    module, dm = module_and_data(DigitSuite(), micro_batch_size=micro_batch_size, group_size=4, tasks_per_step=2,
                                 algorithm=AlgorithmConfig(policy_loss="pg"), log_grad_variance=log_grad_variance)
    chunks = []
    original = module.micro_batch_loss

    def recorded(micro, totals):  # the policy loss's gradient of each micro-batch, computed apart
        losses = original(micro, totals)
        params = [p for p in module.policy.parameters() if p.requires_grad]
        grads = torch.autograd.grad(losses["loss_rl"], params, retain_graph=True, allow_unused=True)
        chunks.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)]).double())
        return losses

    module.micro_batch_loss = recorded
    last = LastStep()
    quiet_trainer(1, deterministic=True, callbacks=[last]).fit(module, dm)
    return module, chunks, last.output["metrics"]


def test_the_variance_of_the_micro_batch_gradients_is_logged_and_the_update_is_unchanged():
    module, chunks, metrics = one_step(True, micro_batch_size=2)
    assert metrics["train/policy_grad_chunks"] == len(chunks) == 4
    g = torch.stack(chunks)
    variance, relative = gradient_variance(g.pow(2).sum(-1), float(g.sum(0).pow(2).sum()))
    assert variance > 0
    assert math.isclose(metrics["train/policy_grad_var"], variance, rel_tol=1e-5)
    assert math.isclose(metrics["train/policy_grad_var_rel"], relative, rel_tol=1e-5)
    plain, _, plain_metrics = one_step(False, micro_batch_size=2)
    assert "train/policy_grad_chunks" not in plain_metrics
    for (name, a), b in zip(module.policy.state_dict().items(), plain.policy.state_dict().values()):
        assert torch.equal(a, b), name  # the extra backward leaves the update as it was
    assert 0 < metrics["train/entropy_rl"] <= math.log(module.policy.config.vocab_size)


def test_one_micro_batch_counts_itself_and_logs_no_variance():
    _, _, metrics = one_step(True, micro_batch_size=64)
    assert metrics["train/policy_grad_chunks"] == 1.0
    assert "train/policy_grad_var" not in metrics
