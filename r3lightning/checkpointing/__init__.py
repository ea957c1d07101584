"""Checkpoint files above the module: writing them whole (``io``), reading a user's file (``read``), what a
resume may change (``resume``), and export as a Hugging Face model (``export``). The module's own
checkpoint section lives below it, in ``r3lightning.training.checkpoint_state``."""
