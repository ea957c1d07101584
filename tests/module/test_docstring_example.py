"""R3LightningModule's docstring opens with an example, as TRL's trainers do; it must run as written."""

import textwrap

from r3lightning.module import R3LightningModule


def test_the_module_docstring_example_runs_as_written():
    doc = R3LightningModule.__doc__
    assert doc.index("Example:") < doc.index("Args:")
    code = textwrap.dedent(doc.split("::\n", 1)[1].split("\n    Args:\n", 1)[0])
    namespace: dict = {}
    exec(compile(code, "R3LightningModule.__doc__", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 2 and namespace["module"].policy is not None
