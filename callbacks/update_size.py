"""How far one optimizer step moved the policy: the KL divergence from the policy that sampled the step
(its behaviour log-probs) to the updated one, on the step's own RL tokens. A step that moves a pretrained
policy by whole nats per token has usually wrecked it (a learning rate meant for a tiny model copied to a
real one took greedy validation from 2/2 to 0/2 in one update); ``ComponentHealth`` reports and, strict,
stops on it (``health.update_kl_max``)."""

from __future__ import annotations

from typing import Optional

import torch

from r3lightning.types import ExperienceBatch


@torch.no_grad()
def update_kl(policy: torch.nn.Module, experience: ExperienceBatch, max_rows: int) -> Optional[tuple[float, int]]:
    """``(KL, tokens)``: the mean per-token KL(behaviour || updated policy) over the RL tokens of the first
    ``max_rows`` rows of ``experience`` whose behaviour log-probs were sampled (not stored or pinned),
    estimated on the sampled tokens as ``r - 1 - log r`` with ``r = p_new / p_behaviour`` (non-negative,
    unbiased), logits scaled by the step's sampling temperature; None when there is no such token.
    One extra forward pass of at most ``max_rows`` rows, in eval mode (no dropout, no random draws)."""
    has_rl = experience.loss_mask[:, 1:].sum(dim=1) > 0
    sampled = [not experience.behaviour or experience.behaviour[i] == "sampled" for i in range(len(has_rl))]
    rows = [i for i in range(len(has_rl)) if has_rl[i] and sampled[i]][:max_rows]
    if not rows:
        return None
    device = next(policy.parameters()).device
    ids = experience.input_ids[rows].to(device)
    attention = experience.attention_mask[rows].to(device)
    mask = experience.loss_mask[rows, 1:].to(device).bool()
    was_training = policy.training
    policy.eval()
    try:
        logits = policy(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    finally:
        policy.train(was_training)
    logp = torch.log_softmax(logits / max(float(experience.temperature), 1e-6), dim=-1)
    new = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    log_ratio = (new - experience.old_logprobs[rows, 1:].to(device).float())[mask]
    kl = (torch.exp(log_ratio) - 1 - log_ratio).mean()
    return float(kl), int(mask.sum())
