"""ReflectRL's data: the golden-negative pool (``gnt_pool``) and the stage-1 reflective SFT rows
(``reflective_sft``). Written by ``r3l gnt-pool`` / ``r3l reflect-sft`` (``r3lightning.cli.reflectrl``)."""
