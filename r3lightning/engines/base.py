"""The rollout-engine protocol: token ids in, sampled token ids and behaviour log-probs out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

FinishReason = Literal["stop", "length"]


@dataclass
class SamplingParams:
    """How to sample. The same fields mean the same thing for every engine.

    Args:
        temperature: softmax temperature; 0 means greedy decoding.
        top_p: nucleus sampling mass (1.0 disables it).
        top_k: sample among the ``top_k`` most likely tokens only (ties with the k-th kept); 0 disables it.
        min_p: sample among tokens at least ``min_p`` times as likely as the most likely one; 0 disables it.
            The truncations (top-k, then min-p, then top-p) choose which tokens may be drawn; a token's
            behaviour log-prob stays that of the whole softmax(logits / temperature) on the ``hf``
            engine, which is what the trainer recomputes (docs/engines.md).
        max_new_tokens: generation budget per call.
        stop: extra stop strings; generation ends after the token that completes one (kept in the output).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1) (0 disables it), got {self.min_p}")
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if problems:
            raise ValueError("sampling (data.sampling / data.val_sampling): " + "; ".join(problems))

    @property
    def truncation(self) -> tuple[float, int, float]:
        """(top_p, top_k, min_p): which tokens the sampler may draw."""
        return (self.top_p, self.top_k, self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Generation:
    """One completion: token_ids, their behaviour log-probs (log softmax of logits / temperature,
    before top-p filtering, the distribution the trainer recomputes), and why it ended: ``stop``
    (end-of-turn token or stop string) or ``length`` (budget exhausted)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class RolloutEngine(Protocol):
    """Batched generation on the current policy weights.

    Weight sync is not part of the protocol: the ``hf`` engine decodes with the trainer's own
    parameters, and an engine that holds a copy (``vllm``, ``needs_weight_sync = True``) is kept
    current by the ``VLLMWeightSync`` callback, which ``r3l`` adds whenever ``model.engine.backend``
    is ``vllm`` (docs/engines.md)."""

    weight_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Complete every prompt (token ids) once; returns one Generation per prompt, in order."""


def truncate_at_stop(
    token_ids: list[int],
    logprobs: list[float],
    stop_token_ids: set[int],
    stop_strings: list[str],
    decode: Callable[[list[int]], str],
    budget_exhausted: bool,
) -> Generation:
    """Cut a raw completion after its first stop token or stop string; ``decode`` maps ids to text.

    Engines may run past a stop (batched decoding, padding); this gives every engine the same rule.
    """
    end = len(token_ids)
    reason: FinishReason = "length"
    for i, tok in enumerate(token_ids):
        if tok in stop_token_ids:
            end, reason = i + 1, "stop"
            break
    if stop_strings:
        for i in range(end):
            text = decode(token_ids[: i + 1])
            if any(s in text for s in stop_strings):
                end, reason = i + 1, "stop"
                break
    if reason == "length" and not budget_exhausted:
        reason = "stop"
    return Generation(token_ids=token_ids[:end], logprobs=logprobs[:end], finish_reason=reason)

