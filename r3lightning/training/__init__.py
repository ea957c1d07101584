"""What the training module is built from, beside ``r3lightning.module``: the policy model and tokenizer
(``models``), the optimizer settings and learning-rate schedule (``optim``), and what its checkpoints hold
(``checkpoint_state``)."""
