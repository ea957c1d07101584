"""What an environment call that missed its deadline raises (``r3lightning.rollout.env_calls`` runs every
environment call under ``agent.step_timeout_s``)."""

from __future__ import annotations


class CallTimeout(Exception):
    """The call did not return within its deadline."""
