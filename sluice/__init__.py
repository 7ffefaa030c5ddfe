"""sluice: production LLM serving.

    from sluice import LLM, SamplingParams
    llm = LLM("smollm2")
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].text)

``import sluice`` stays light: it imports no layer (the gateway and the bench,
which never load the engine, import this package too); ``LLM``,
``RequestOutput`` and ``SamplingParams`` are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.types import Priority

if TYPE_CHECKING:
    from sluice.engine.llm import LLM, RequestOutput
    from sluice.engine.protocol import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "Priority", "__version__"]
__version__ = "0.1.0"

# NOTE(lazy-exports): name -> module; imported by __getattr__ on first use.
_LAZY = {"LLM": "sluice.engine.llm", "RequestOutput": "sluice.engine.llm", "SamplingParams": "sluice.engine.protocol"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")
