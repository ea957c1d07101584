"""The one vocabulary of r3lightning: Turn, Trajectory, Group, ExperienceBatch, and what a training step
gives its callbacks, StepOutput (docs/design.md).

Token bookkeeping is incremental: a turn stores only the tokens that were *added* to the context
before it (``context_ids``: the whole prompt for the first turn, the rendered environment message
for later ones) and the tokens the engine generated (``response_ids``). The full context a turn saw is
the concatenation of everything before it, so a trajectory is one token sequence whose every token
knows which turn produced it. Nothing is ever re-tokenized from text afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Mapping, Optional, TypedDict

import torch

ORIGINS = ("base", "distilled", "replay", "in_context", "reflect_sft", "retry_sft", "demo", "off_policy")
"""Where a trajectory came from. ``*_sft`` and ``demo`` trajectories are trained by the SFT head,
the others by the RL head. ``off_policy`` marks refinements used by Critique-GRPO."""

SFT_ORIGINS = frozenset({"reflect_sft", "retry_sft", "demo"})


@dataclass
class Turn:
    """One assistant message in context.

    context_ids: tokens appended to the context right before this turn (prompt, observation, feedback
        rendered by the chat template, or nothing for a continued reasoning step).
    response_ids: tokens the engine generated for this turn.
    logprobs: behaviour log-probs of ``response_ids`` as returned by the engine (same length), or
        None for text that was not sampled (demonstrations, SFT targets).
    feedback: natural-language feedback the environment returned after this turn.
    action: the action parsed from the response (what the environment received).
    observation: the user message text this turn answered (for reflection transcripts).
    trainable: False for turns that are context only (for example replayed prefix actions that the
        loss must never touch, independent of pivot masking).
    malformed: no action could be parsed from the response: the environment was not stepped and the
        next message is the format feedback (a replay repeats exactly that).
    """

    context_ids: list[int]
    response_ids: list[int]
    logprobs: Optional[list[float]] = None
    feedback: str = ""
    action: str = ""
    observation: str = ""
    trainable: bool = True
    malformed: bool = False

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"Turn: {len(self.logprobs)} logprobs for {len(self.response_ids)} response tokens"
            )


def message_count(turns: list[Turn]) -> int:
    """Assistant messages in ``turns``: the step turns of one split reasoning message (all but the
    first have no context of their own) count as one."""
    return sum(1 for i, turn in enumerate(turns) if i == 0 or turn.context_ids)


EndReason = Literal[
    "", "done", "max_turns", "context_limit", "invalid_action", "env_error", "length", "script_end", "replay_failed"
]
"""Why an episode ended (empty for trajectories that were not played by the agent loop). ``replay_failed``:
replaying a retry's prefix ended the episode or the environment failed before the first new turn."""


@dataclass
class GuidedTurn:
    """Where guidance was shown in an episode: turn ``index``, whose ``context_ids`` include the
    guidance, and the context tokens that turn would have had without it (``unguided_context``).
    Context distillation swaps exactly those tokens and nothing else."""

    index: int
    unguided_context: list[int]


@dataclass
class Trajectory:
    """A whole episode of one task.

    pivot: turn (or step) index from which the trajectory diverges from its partner (R³L); turns
        before it are masked out of the loss when pivotal credit is on. None when there is no pivot.
    model_version: optimizer-step count of the weights that generated it (staleness checks, replay).
    end_reason: why the episode ended (``EndReason``).
    invalid_actions: turns whose action could not be parsed (malformed).
    rejected_actions: actions the environment rejected (``StepResult.info["invalid_action"]``).
    guided_turn: the turn that showed guidance (``GuidedTurn``), None for unguided episodes or when
        the episode ended before that turn was played.
    env_error: the exception text when the environment failed (``end_reason == "env_error"``).
    reward_invalid: the environment's reward was not a finite number (or out of range, when masked):
        the sample is masked like a reward error.
    reward_clipped: the environment's reward lay outside [0, 1] and was clipped into it.
    partial_credit: how close a failed answer came to the reference, in [0, 1], when the environment
        can tell (``StepResult.info["partial_credit"]`` of the last step; math: the numeric distance of
        a readable wrong answer); None otherwise. Only R³'s premise gate reads it
        (``activity/ranking_credit_corr``); no reward or advantage does.
    info: free-form diagnostics shown in sample logs (reflection text, its parse error...); nothing
        reads it to decide anything.
    """

    task_id: str
    turns: list[Turn]
    reward: float = 0.0
    success: bool = False
    truncated: bool = False
    origin: str = "base"
    pivot: Optional[int] = None
    model_version: int = 0
    reward_error: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    end_reason: EndReason = ""
    invalid_actions: int = 0
    rejected_actions: int = 0
    guided_turn: Optional[GuidedTurn] = None
    env_error: str = ""
    reward_invalid: bool = False
    reward_clipped: bool = False
    partial_credit: Optional[float] = None

    def __post_init__(self) -> None:
        if self.origin not in ORIGINS:
            raise ValueError(f"Trajectory {self.task_id!r}: unknown origin {self.origin!r}; expected one of {ORIGINS}")

    @property
    def is_sft(self) -> bool:
        return self.origin in SFT_ORIGINS

    def token_ids(self) -> list[int]:
        """The whole episode as one token sequence."""
        ids: list[int] = []
        for turn in self.turns:
            ids.extend(turn.context_ids)
            ids.extend(turn.response_ids)
        return ids

    def context_of(self, turn_index: int) -> list[int]:
        """The full context turn ``turn_index`` saw (all earlier tokens plus its own context_ids)."""
        ids: list[int] = []
        for i, turn in enumerate(self.turns):
            ids.extend(turn.context_ids)
            if i == turn_index:
                return ids
            ids.extend(turn.response_ids)
        raise IndexError(f"Trajectory {self.task_id!r} has {len(self.turns)} turns, asked for {turn_index}")

    @property
    def num_messages(self) -> int:
        """Assistant messages (``message_count``): 1 for a single-turn answer split into steps."""
        return message_count(self.turns)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)

    @property
    def actions(self) -> list[str]:
        return [t.action for t in self.turns]


@dataclass
class Group:
    """The trajectories of one task that are normalized together (base, distilled, replayed...)."""

    task_id: str
    trajectories: list[Trajectory]
    task: Any = None

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


@dataclass
class ExperienceBatch:
    """Padded training tensors, right-padded, shape [B, T] unless noted.

    Per-token values are aligned with ``input_ids``: ``old_logprobs[b, t]`` is the behaviour log-prob
    of token ``input_ids[b, t]`` given the tokens before it. Position 0 is never a loss token.

    loss_mask: 1 on tokens trained by the RL head (assistant tokens after pivot masking).
    sft_mask: 1 on tokens trained by the SFT head.
    turn_index: index of the turn that generated each assistant token, -1 elsewhere.
    advantages: per-token advantage (the sequence's advantage broadcast on its loss tokens).
    sequence_advantages: [B] each row's advantage before the loss mask (``make_experience``'s, computed
        once; R³'s ranking adjusts the RL rows' from it); None for batches built elsewhere.
    rewards: [B] per-sequence reward; ``origins`` and ``task_ids`` are per-sequence lists.
    temperature: the sampling temperature of the RL rows (the trainer scores them under it).
    behaviour: per row, what ``old_logprobs`` are: ``sampled`` (the engine's, may be recomputed by the
        trainer), ``stored`` (a replayed sample's, from the policy that made it: never recomputed, so
        the ratio corrects for its age) or ``pinned`` (none usable: the ratio is held at 1). Empty
        means every row is ``sampled``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    sft_mask: torch.Tensor
    turn_index: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    rewards: torch.Tensor
    ref_logprobs: Optional[torch.Tensor] = None
    origins: list[str] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    temperature: float = 1.0
    behaviour: list[str] = field(default_factory=list)
    sequence_advantages: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def behaviour_of_rows(self) -> list[str]:
        return self.behaviour or ["sampled"] * len(self)

    def to(self, device: torch.device | str) -> "ExperienceBatch":
        moved = {}
        for name, value in self.__dict__.items():
            moved[name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return ExperienceBatch(**moved)

    def micro_batches(self, size: int) -> list[torch.Tensor]:
        """Row indices of micro-batches of at most ``size`` rows, longest rows first (stable), so each
        micro-batch pads its rows only to rows of similar length. Every loss is a global sum over rows,
        so the grouping changes nothing but the floating-point summation order."""
        if size < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {size}")
        order = torch.argsort(self.attention_mask.sum(dim=1), descending=True, stable=True)
        return list(order.split(size))

    def take(self, rows: torch.Tensor) -> "ExperienceBatch":
        """The rows at indices ``rows`` (a micro-batch), trimmed to the longest of them."""
        length = int(self.attention_mask[rows].sum(dim=1).max().item()) if len(rows) else 0
        picked = {}
        for name, value in self.__dict__.items():
            if isinstance(value, torch.Tensor):
                value = value[rows]
                if value.dim() == 2:
                    value = value[:, :length]
                picked[name] = value
            elif isinstance(value, list):
                picked[name] = [value[i] for i in rows.tolist()] if value else []
            else:
                picked[name] = value
        return ExperienceBatch(**picked)

    def slice(self, start: int, end: int) -> "ExperienceBatch":
        """Rows ``start:end``, trimmed to the longest row in them."""
        return self.take(torch.arange(start, min(end, len(self))))


class StepOutput(TypedDict):
    """What ``R3LightningModule.training_step`` returns: Lightning hands it to every callback's
    ``on_train_batch_end(trainer, module, outputs, batch, batch_idx)`` as ``outputs`` (``step_output``
    reads it).

    loss: the step's loss (a detached scalar tensor; ``train/loss``).
    metrics: every scalar the step logged (``trainer.callback_metrics`` also keeps stale values of tags
        an earlier step logged and this one did not).
    trajectories: the step's trajectories, RL and SFT rows.
    experience: the collated batch the step trained on (None for a step that returned nothing).
    """

    loss: Optional[torch.Tensor]
    metrics: dict[str, float]
    trajectories: list[Trajectory]
    experience: Optional[ExperienceBatch]


def step_output(outputs: Any) -> StepOutput:
    """``on_train_batch_end``'s ``outputs`` as a ``StepOutput``: empty (no metrics, trajectories or
    experience) where the step returned nothing (a module whose ``training_step`` returns None)."""
    given = outputs if isinstance(outputs, Mapping) else {}
    return StepOutput(loss=given.get("loss"), metrics=given.get("metrics", {}), trajectories=given.get("trajectories", []),
                      experience=given.get("experience"))
