"""A fake engine core that answers from a script in the prompt, for the structured-output and tool tests.

``FakeEngineCore`` (sluice.server.testing) with two rules on top, so API tests
can drive exact answers through the real server without a model:

- a prompt holding ``SAY<<text>>SAY`` is answered with ``text`` (bytes of the fake
  codec), then EOS (finish_reason 'stop');
- a prompt holding ``ECHO_CONSTRAINT`` is answered with the engine request's
  ``sampling.structured`` as JSON (``null`` when unconstrained): what reached the engine;
- a prompt holding ``ECHO_PROMPT`` is answered with the prompt itself (the rendered chat),
  each ``<`` written ``&lt;`` (so tags in it are not taken for the answer's own tool calls).

A constrained request whose prompt holds ``REJECT_CONSTRAINT`` is refused as the engine
refuses a grammar it cannot compile (``InvalidRequestError``, param ``structured_outputs``).

The last ``SAY<<...>>SAY`` of the prompt counts (a history may hold earlier ones).
"""

from __future__ import annotations

import re

import msgspec

from sluice.engine.protocol import EngineRequest
from sluice.errors import InvalidRequestError
from sluice.server.testing import EOS, FakeEngineCore, _Req

_SAY = re.compile(rb"SAY<<(.*?)>>SAY", re.S)


class ScriptedEngineCore(FakeEngineCore):
    def add_request(self, req: EngineRequest) -> None:
        if req.sampling.structured is not None and b"REJECT_CONSTRAINT" in bytes(t for t in req.prompt_token_ids if t < 256):
            raise InvalidRequestError("invalid structured output constraint: scripted", param="structured_outputs")
        req.sampling.stop_token_ids = [*req.sampling.stop_token_ids, EOS]
        super().add_request(req)

    def _next_token(self, r: _Req) -> int:
        prompt = bytes(t for t in r.req.prompt_token_ids if t < 256)
        if b"ECHO_CONSTRAINT" in prompt:
            script = msgspec.json.encode(r.req.sampling.structured)
        elif b"ECHO_PROMPT" in prompt:
            script = prompt.replace(b"<", b"&lt;")
        else:
            said = _SAY.findall(prompt)
            if not said:
                return super()._next_token(r)
            script = said[-1]
        i = len(r.output)
        return script[i] if i < len(script) else EOS
