"""The ``r3l`` commands, the top layer: ``console`` (the script's entry, standard library only), ``main``
(LightningCLI's ``fit`` and ``validate``), ``export``, ``reflectrl`` (``gnt-pool``, ``reflect-sft``).

Kept empty: ``r3lightning.cli.console`` must import without Lightning."""
