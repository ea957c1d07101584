"""What ``RolloutDataModule.rollout`` hands the module: one step's exploration and how to score it."""

from __future__ import annotations

from dataclasses import dataclass

from r3lightning.rollout.explorers.base import Exploration


@dataclass
class StepRollout:
    """One training step's samples with what the objective reads from the data side, so that a step
    reads nothing else of the datamodule (``make_experience`` takes it whole).

    exploration: the RL groups, the SFT samples and the explorer's figures.
    max_reward: the reward of a full success (``data.max_reward``): positive amplification, ``raft``'s
        filter, R³'s failures and the success figures read it.
    temperature: the temperature the RL rows were sampled at, under which the trainer scores them (1
        for greedy rollouts).
    replay_behaviour: what replayed rows' behaviour log-probs are (``data.replay.behaviour``):
        ``stored`` (the policy's that sampled them) or ``pinned`` (scored as if on-policy).
    seed: the step's rollout seed (per seed, step and rank), from which the step's other random
        choices derive (the placebo ranking's order).
    """

    exploration: Exploration
    max_reward: float = 1.0
    temperature: float = 1.0
    replay_behaviour: str = "stored"
    seed: int = 0
