"""``r3l export --ckpt_path X.ckpt --out DIR``: a checkpoint's policy as a Hugging Face model directory
(``r3lightning.checkpointing.export`` does the work)."""

from __future__ import annotations

import argparse
import os
from typing import Optional

from r3lightning.checkpointing.export import export_checkpoint


def main(argv: Optional[list[str]] = None) -> None:
    """``r3l export --ckpt_path run.ckpt --out model_dir [--lora merged|adapter]``."""
    parser = argparse.ArgumentParser(
        prog="r3l export", description="Export an r3lightning checkpoint's policy as a Hugging Face model directory."
    )
    parser.add_argument("--ckpt_path", required=True, help="checkpoint file written during training (.ckpt)")
    parser.add_argument("--out", required=True, help="directory to write (created; must be empty)")
    parser.add_argument(
        "--lora",
        choices=("merged", "adapter"),
        default="merged",
        help="LoRA policies: merge the adapters into the weights (default) or write the PEFT adapter only",
    )
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt_path, args.out, lora=args.lora)
    except (ValueError, OSError) as err:
        # A bad file or setting is bad input (status 1, as for ``r3l fit``); argparse's usage errors exit 2.
        if os.environ.get("R3L_TRACEBACK", "0") not in ("", "0"):
            raise
        parser.exit(1, f"r3l export: error: {' '.join(str(err).split())}\n")
    print(f"r3l export: wrote {out}")
