"""sluice: production LLM serving.

    from sluice import LLM, SamplingParams
    llm = LLM("smollm2")
    print(llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0].text)

``import sluice`` stays light: the torch-backed ``LLM`` is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluice.engine.protocol import SamplingParams
from sluice.types import Priority

if TYPE_CHECKING:
    from sluice.engine.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "Priority", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from sluice.engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")
