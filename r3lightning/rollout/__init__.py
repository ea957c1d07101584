"""Rollout layer: engines, the agent loop and explorers."""
