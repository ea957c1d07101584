"""r3lightning: RL of language models with reflection on PyTorch Lightning.

This top-level module stays import-light (no lightning, no transformers) so that
``r3lightning.algos`` can be used on its own. Import the heavy pieces from their modules:
``r3lightning.module``, ``r3lightning.data``, ``r3lightning.rollout``, ``r3lightning.cli.main``.
"""

__version__ = "0.1.0"
