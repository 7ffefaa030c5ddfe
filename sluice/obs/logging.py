"""Structured logs: one JSON object per line.

``configure_logging(level)`` sends every ``sluice.*`` record to stderr as JSON;
the server logs one line per finished request on the ``sluice.request`` logger
with its id, priority, token counts and stage timings (never an API key: only
the key's fingerprint).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

__all__ = ["JsonFormatter", "configure_logging", "REQUEST_LOGGER"]

REQUEST_LOGGER = "sluice.request"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc["event"] = record.getMessage()
            doc.update(fields)
        else:
            doc["msg"] = record.getMessage()
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("sluice")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
