"""Structured outputs from ``sluice serve`` with the official OpenAI client.

    make serve                                   # or: sluice serve --model smollm2 --port 8000
    python examples/structured_outputs.py        # SLUICE_URL=http://127.0.0.1:8000/v1 by default

``client.chat.completions.parse(..., response_format=APydanticModel)`` sends the
model's JSON schema as ``response_format: json_schema``; the engine masks every
token with it, so the answer always parses, even from a 135M model.  Then vLLM's
extras through ``extra_body``: a regular expression and a choice; and a bad
schema, refused with a 400 that names the parameter (docs/structured_outputs.md).
"""

from __future__ import annotations

import os
from typing import Literal

import openai
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float = Field(ge=0, le=50)
    size: Literal["small", "medium", "large"]


def main() -> None:
    client = openai.OpenAI(
        base_url=os.environ.get("SLUICE_URL", "http://127.0.0.1:8000/v1"),
        api_key=os.environ.get("SLUICE_API_KEY", "none"),
    )
    model = client.models.list().data[0].id

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse  # older clients
    r = parse(
        model=model,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_tokens=120,
        temperature=0,
    )
    city = r.choices[0].message.parsed
    print("parsed:", repr(city))

    phone = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a phone number."}],
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\+33 [1-9]( [0-9]{2}){4}"}},
    )
    print("regex: ", phone.choices[0].message.content)

    mood = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is 'I loved this film' positive or negative?"}],
        max_tokens=5,
        temperature=0,
        extra_body={"guided_choice": ["positive", "negative"]},
    )
    print("choice:", mood.choices[0].message.content)

    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}},
        )
    except openai.BadRequestError as e:
        print("400:   ", e.body)


if __name__ == "__main__":
    main()
