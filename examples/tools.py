"""A two-turn tool loop against ``sluice serve``: the model calls a function, we run it, it answers.

    make serve                                   # or: sluice serve --model smollm2 --port 8000
    python examples/tools.py                     # SLUICE_URL=http://127.0.0.1:8000/v1 by default

Turn 1 asks with ``tool_choice="required"``: the call is grammar-constrained, so its
arguments always parse and match the function's ``parameters`` schema, on any model
(SmolLM2's chat template has no tool section: sluice describes the tools in its
default tool prompt, docs/structured_outputs.md).  Turn 2 sends the call and its
result back (an assistant message with ``tool_calls``, a ``role: "tool"`` message)
and lets the model answer in text (``tool_choice="auto"``).  The first turn is
streamed: the call's id and name come first, then fragments of its arguments.
"""

from __future__ import annotations

import json
import os
from typing import Any

import openai

TOOLS: list[Any] = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}]  # fmt: skip


def get_weather(city: str, unit: str) -> dict[str, Any]:
    """A stand-in for a real weather service."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit, "sky": "clear"}


def main() -> None:
    client = openai.OpenAI(
        base_url=os.environ.get("SLUICE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("SLUICE_API_KEY", "none"),
    )
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris right now?"}]

    # turn 1: a required call, streamed; the client's stream helper accumulates the deltas
    with client.chat.completions.stream(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=80, temperature=0) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                print(f"  arguments += {event.arguments_delta!r}")
        first = stream.get_final_completion()
    message = first.choices[0].message
    print("finish_reason:", first.choices[0].finish_reason)
    messages.append(message)
    for call in message.tool_calls or []:
        args = json.loads(call.function.arguments)  # always valid: the call was grammar-constrained
        result = get_weather(**args)
        print(f"call {call.id}: {call.function.name}({args}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})

    # turn 2: the model sees the call and its result, and answers in text
    second = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="auto",
                                            max_tokens=60, temperature=0)  # fmt: skip
    print("answer:", second.choices[0].message.content)


if __name__ == "__main__":
    main()
