"""An online W&B logger that cannot start is one clear line within seconds, not a 50-line traceback after
W&B's own 90 s of retries: the service must answer a TCP connection first, and the run is started before
training with the error (no API key, refused login) caught and named with the offline switch."""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlparse

CONNECT_TIMEOUT_S = 5.0
"""How long the W&B service gets to accept a connection before ``r3l`` says it cannot be reached."""
OFFLINE_HINT = "or set trainer.logger.init_args.offline: true (or WANDB_MODE=offline) and `wandb sync` the run later"


def _is_online_wandb(logger: Any) -> bool:
    return type(logger).__name__ == "WandbLogger" and not getattr(logger, "_offline", False) and \
        os.environ.get("WANDB_MODE", "online") not in ("offline", "disabled", "dryrun")


def check_wandb_loggers(loggers: list) -> None:
    """Start every online ``WandbLogger`` of ``loggers`` now; a ``ValueError`` naming the logger, the
    cause and the offline switch when the service cannot be reached or the run cannot start."""
    for logger in loggers:
        if not _is_online_wandb(logger):
            continue
        import wandb

        url = urlparse(os.environ.get("WANDB_BASE_URL") or wandb.Settings().base_url)
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as err:
            raise ValueError(
                f"trainer.logger (WandbLogger): cannot reach the W&B service at {url.geturl()} ({err.strerror or err}); "
                f"check the network or WANDB_BASE_URL, {OFFLINE_HINT}"
            ) from None
        os.environ.setdefault("WANDB_INIT_TIMEOUT", "30")  # W&B's own default waits 90 s, then retries
        try:
            logger.experiment
        except Exception as err:  # noqa: BLE001 - wandb's UsageError/CommError/AuthenticationError...
            text = " ".join(str(err).split())
            hint = "run `wandb login` or set WANDB_API_KEY, " if "api key" in text.lower() or "login" in text.lower() else ""
            raise ValueError(f"trainer.logger (WandbLogger): {type(err).__name__}: {text}; {hint}{OFFLINE_HINT}") from None
