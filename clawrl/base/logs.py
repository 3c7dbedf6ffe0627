"""Process logging for every clawrl service: one format, and quiet libraries.

The proxy polls the engine's `/model_info` every few seconds and the judge and trainer call
it often; httpx logs each request at INFO, which buried the lines a user reads. Libraries'
request logs appear only when the process runs at DEBUG.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
# Loggers of libraries that log every request at INFO.
CHATTY = ("httpx", "httpcore", "urllib3", "filelock")


def setup_logging(level: str | int = "INFO", fmt: str = FORMAT) -> None:
    """Configure the root logger at `level`; chatty libraries log warnings only, unless
    `level` is DEBUG."""
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    logging.basicConfig(level=numeric, format=fmt)
    for name in CHATTY:
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else logging.WARNING)
