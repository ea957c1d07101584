"""Explorers turn tasks into groups of trajectories: plain group sampling (``base``), R³L's
reflect-then-retry (``reflect_retry``), Reflect-GRPO (``reflect_from_scratch``), Critique-GRPO
(``critique_refine``), R³'s in-context reflection (``in_context``), and the reflections they share
(``reflection``)."""
