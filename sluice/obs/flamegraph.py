"""Collapsed stacks (py-spy ``--format raw``) -> a flame graph SVG and a speedscope profile.

One sampling run per process gives collapsed stacks, one line per distinct
stack, root first::

    <module> (sluice/cli.py:52);main (sluice/cli.py:47);step (engine/core.py:98) 37

``merge`` puts several processes under one root frame each (``api (pid 12)``,
``engine_core (pid 13)``), so one SVG shows both sides of ``sluice serve``;
``to_speedscope`` keeps one profile per process (speedscope's tabs).  Both are
pure; the SVG needs no script and opens in any browser (hover a frame for its
samples and share).
"""

from __future__ import annotations

import html
import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["parse_collapsed", "Frame", "merge", "to_svg", "to_speedscope"]

Stacks = dict[tuple[str, ...], int]  # stack (root first) -> samples


def parse_collapsed(text: str) -> Stacks:
    """``a;b;c 12`` lines -> {("a", "b", "c"): 12}; malformed lines are skipped."""
    stacks: Stacks = {}
    for line in text.splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        key = tuple(stack.split(";"))
        stacks[key] = stacks.get(key, 0) + int(count)
    return stacks


@dataclass
class Frame:
    name: str
    samples: int = 0
    children: dict[str, Frame] = field(default_factory=dict)

    def add(self, stack: Iterable[str], samples: int) -> None:
        node = self
        node.samples += samples
        for name in stack:
            node = node.children.setdefault(name, Frame(name))
            node.samples += samples


def merge(stacks_by_process: Mapping[str, Stacks]) -> Frame:
    """One tree: ``all`` -> one frame per process -> its stacks."""
    root = Frame("all")
    for process, stacks in stacks_by_process.items():
        for stack, n in stacks.items():
            root.add((process, *stack), n)
    return root


# -- SVG -----------------------------------------------------------------------------

_ROW = 16  # px per frame row
_FONT = 11
_CHAR_PX = 6.2  # mean glyph width at _FONT px (monospace-ish estimate, to clip labels)
_MIN_PX = 0.3  # frames narrower than this are not drawn (they would be invisible)


def _color(name: str) -> str:
    # warm palette, stable per function name (same frame -> same color in every graph)
    h = zlib.crc32(name.encode())
    return f"rgb({205 + h % 50},{(h >> 8) % 180 + 40},{(h >> 16) % 55})"


def to_svg(root: Frame, title: str = "sluice profile", width: int = 1200) -> str:
    """A flame graph, root at the bottom, widths proportional to samples."""
    depth = _depth(root)
    height = (depth + 3) * _ROW
    rects: list[str] = []
    total = max(root.samples, 1)
    scale = (width - 20) / total

    def draw(f: Frame, x: float, level: int) -> None:
        w = f.samples * scale
        if w < _MIN_PX:
            return
        y = height - (level + 2) * _ROW
        share = 100.0 * f.samples / total
        label = html.escape(f.name)
        tip = f"{label} ({f.samples} samples, {share:.2f}%)"
        chars = int((w - 4) / _CHAR_PX)
        text = label if len(f.name) <= chars else (html.escape(f.name[: chars - 2]) + ".." if chars > 3 else "")
        rects.append(
            f'<g><title>{tip}</title><rect x="{x + 10:.1f}" y="{y}" width="{max(w - 0.5, 0.1):.1f}" '
            f'height="{_ROW - 1}" fill="{_color(f.name)}" rx="2"/>'
            + (f'<text x="{x + 13:.1f}" y="{y + _ROW - 4}">{text}</text>' if text else "")
            + "</g>"
        )
        cx = x
        for child in sorted(f.children.values(), key=lambda c: c.name):
            draw(child, cx, level + 1)
            cx += child.samples * scale

    draw(root, 0.0, 0)
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="{_FONT}">'
        f'<rect width="100%" height="100%" fill="#fdfdf6"/>'
        f'<text x="{width / 2}" y="{_ROW}" text-anchor="middle" font-size="{_FONT + 4}">{html.escape(title)}</text>'
    )
    return head + "".join(rects) + "</svg>\n"


def _depth(f: Frame) -> int:
    return 1 + max((_depth(c) for c in f.children.values()), default=0)


# -- speedscope ----------------------------------------------------------------------


def _split_frame(name: str) -> dict[str, Any]:
    """``step (sluice/engine/core.py:98)`` -> name, file, line."""
    fn, sep, rest = name.partition(" (")
    if not sep or not rest.endswith(")"):
        return {"name": name}
    loc = rest[:-1]
    file, _, line = loc.rpartition(":")
    if file and line.isdigit():
        return {"name": fn, "file": file, "line": int(line)}
    return {"name": fn, "file": loc}


def to_speedscope(stacks_by_process: Mapping[str, Stacks], rate: float, name: str = "sluice profile") -> str:
    """speedscope's file format: shared frames, one sampled profile per process (weights in seconds)."""
    frames: list[dict[str, Any]] = []
    index: dict[str, int] = {}
    profiles = []
    for process, stacks in stacks_by_process.items():
        samples, weights = [], []
        for stack, n in sorted(stacks.items()):
            ids = []
            for fr in stack:
                if fr not in index:
                    index[fr] = len(frames)
                    frames.append(_split_frame(fr))
                ids.append(index[fr])
            samples.append(ids)
            weights.append(n / rate)
        profiles.append({"type": "sampled", "name": process, "unit": "seconds", "startValue": 0,
                         "endValue": sum(weights), "samples": samples, "weights": weights})  # fmt: skip
    doc = {"$schema": "https://www.speedscope.app/file-format-schema.json", "name": name, "exporter": "sluice",
           "activeProfileIndex": 0, "shared": {"frames": frames}, "profiles": profiles}  # fmt: skip
    return json.dumps(doc)
