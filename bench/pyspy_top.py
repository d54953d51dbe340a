"""Summarize a py-spy ``--format raw`` profile (collapsed stacks): where the samples go.

    python bench/pyspy_top.py bench/results/pyspy-muxproxy-h1-300.txt [--top 20]

Prints the share of samples by layer (the file of the innermost Python frame: trio, h11, h2,
muxproxy core, muxproxy driver, other), the functions with the most self samples, and the
functions with the most inclusive samples. Only samples where the thread was busy are in a
py-spy profile (idle waits are left out unless recorded with ``--idle``), so the shares are
of the CPU the process used.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")

LAYERS = (
    ("muxproxy/trio/", "muxproxy driver (muxproxy/trio)"),
    ("muxproxy/core/", "muxproxy sans-IO core (muxproxy/core)"),
    ("muxproxy/", "muxproxy other"),
    ("h11/", "h11"),
    ("h2/", "h2 / hpack / hyperframe"),
    ("hpack/", "h2 / hpack / hyperframe"),
    ("hyperframe/", "h2 / hpack / hyperframe"),
    ("trio/", "trio"),
    ("attr/", "attrs"),
    ("attrs/", "attrs"),
)


def layer(path: str) -> str:
    for prefix, name in LAYERS:
        if prefix in path:
            return name
    return "stdlib / other"


def parse(path: str) -> list[tuple[list[tuple[str, str]], int]]:
    stacks = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            frames = []
            for raw in stack.split(";"):
                m = FRAME.match(raw)
                frames.append((m["func"], m["file"]) if m else (raw, ""))
            stacks.append((frames, int(count)))
    return stacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    stacks = parse(args.profile)
    total = sum(c for _, c in stacks)
    if not total:
        print("no samples")
        return
    layers: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks:
        func, path = frames[-1]
        layers[layer(path)] += count
        self_time[f"{func} ({path})"] += count
        for name in {f"{f} ({p})" for f, p in frames}:
            inclusive[name] += count
    print(f"{total} samples (py-spy --nonblocking may cut some stacks short)")
    print("\nby layer (innermost Python frame):")
    for name, count in layers.most_common():
        print(f"  {100 * count / total:5.1f}%  {name}")
    print(f"\ntop {args.top} self:")
    for name, count in self_time.most_common(args.top):
        print(f"  {100 * count / total:5.1f}%  {name}")
    print(f"\ntop {args.top} inclusive (below the event loop):")
    # Skip the frames from the entry point down to the event loop, which every sample has.
    above_loop: set[str] = set()
    for frames, _ in stacks:
        names = [f"{f} ({p})" for f, p in frames]
        for i, (func, _path) in enumerate(frames):
            if func == "unrolled_run":
                above_loop.update(names[: i + 1])
                break
    shown = 0
    for name, count in inclusive.most_common():
        if name in above_loop:
            continue
        print(f"  {100 * count / total:5.1f}%  {name}")
        shown += 1
        if shown >= args.top:
            break


if __name__ == "__main__":
    main()
