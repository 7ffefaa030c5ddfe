"""Rebuild english.txt: the prose paragraphs of CPython's pydoc topics (PSF-licensed documentation).

    python sluice/models/quant/data/make_english.py   # writes english.txt beside this file

Keeps paragraphs of running English text (bullets unwrapped, *emphasis*
markers dropped); drops headings, grammar productions, code and doctest
blocks, tables and any paragraph that is mostly symbols.  Deterministic for a
given CPython version (3.11.7 made the committed file).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HEADING_RULE = re.compile(r"^[*=\-~^\"]{3,}$")


def prose_paragraphs(text: str) -> list[str]:
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.rstrip() for ln in block.split("\n") if ln.strip()]
        if not lines or any(HEADING_RULE.match(ln.strip()) for ln in lines):
            continue
        first = lines[0]
        indent = len(first) - len(first.lstrip())
        body = first.strip()
        if body.startswith(("* ", "- ")):
            body = body[2:]
        elif indent:  # indented without a bullet: code, grammar or a quoted example
            continue
        para = " ".join([body] + [ln.strip() for ln in lines[1:]])
        if any(s in para for s in (">>>", "::=", "...:", "+---", "====")):
            continue
        para = re.sub(r"\*([^*\s][^*]*?)\*", r"\1", para)  # *emphasis* -> emphasis
        para = re.sub(r"\s+", " ", para).strip()
        letters = sum(c.isalpha() or c in " ,.;:'’“”()-" for c in para)
        words = para.split()
        if len(words) < 12 or letters / len(para) < 0.93 or not para[0].isupper() or para[-1] not in ".:)":
            continue
        out.append(para)
    return out


def main() -> None:
    import pydoc_data.topics as topics

    paras: list[str] = []
    seen: set[str] = set()
    for key in sorted(topics.topics):
        for p in prose_paragraphs(topics.topics[key]):
            if p not in seen:
                seen.add(p)
                paras.append(p)
    dest = Path(__file__).with_name("english.txt")
    dest.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
    print(f"{dest}: {len(paras)} paragraphs, {sum(len(p) for p in paras)} characters (CPython {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
