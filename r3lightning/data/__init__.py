"""Data layer: task streams, rollouts made from them, collation to ExperienceBatch."""
