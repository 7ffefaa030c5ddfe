"""Suite-wide fixtures.  Each layer keeps its own fixtures in tests/<layer>/conftest.py."""

from __future__ import annotations

import os

# Tests must never reach the network for weights or tokenizers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
