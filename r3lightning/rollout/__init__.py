"""Rollout layer: the agent loop, chat bookkeeping, guarded environment calls, rollout metrics and the explorers."""
