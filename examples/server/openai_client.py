"""Talk to ``sluice serve`` with the official OpenAI client.

    make serve                                   # or: sluice serve --model smollm2 --port 8000
    python examples/server/openai_client.py      # SLUICE_URL=http://127.0.0.1:8000/v1 by default

Shows a chat completion, a streamed completion with usage, and the sluice
extras (priority header, ignore_eos / top_k through ``extra_body``).
"""

from __future__ import annotations

import os

import openai


def main() -> None:
    client = openai.OpenAI(
        base_url=os.environ.get("SLUICE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("SLUICE_API_KEY", "none"),  # any value when the server has no keys
    )
    model = client.models.list().data[0].id

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three colours of the rainbow."}],
        max_tokens=48,
        temperature=0,
    )
    print("chat:", chat.choices[0].message.content)
    print("usage:", chat.usage)

    stream = client.completions.create(
        model=model,
        prompt="The three laws of thermodynamics are",
        max_tokens=40,
        temperature=0.7,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-priority": "p0"},  # capped by your API key's tier
        extra_body={"top_k": 40, "ignore_eos": True},
    )
    print("stream: ", end="")
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
        elif chunk.usage:
            print(f"\n[usage: {chunk.usage.completion_tokens} tokens]")


if __name__ == "__main__":
    main()
