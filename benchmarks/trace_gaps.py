"""Where the device sits idle because the host is late: the idle gaps between the kernels, copies and memsets of a
Chrome trace that torch.profiler exported, each put on what the host was running at its midpoint, the innermost
Tandem frame and the innermost frame of all (a builtin, an aten op, a CUDA runtime call). Tandem frames are the
engine's named ranges (`tandem/profiling.py`: `tandem.LLM.step`, `tandem.core.gated_delta_rule`, ...) and, in a
trace profiled with_stack=True, the project's Python frames.

    python3 benchmarks/trace_gaps.py TRACE.json [--min-us 20] [--top 25]

`benchmarks/step.py --trace DIR` writes such traces (`--trace-stacks`: with Python stacks) and prints this summary
of each. Python tracing slows the host so much that it moves the gaps (docs/BENCHMARKS.md, fourteenth session):
the named ranges alone cost far less.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandem.profiling import PREFIX  # noqa: E402

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
# a host thread's own events; the CUDA runtime and driver calls among them show where it blocked or allocated
HOST_CATS = {"python_function", "cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"}
FRAME = re.compile(r"(.+)\((\d+)\): ")
# the profiler names a file relative to its sys.path entry, so `python3 benchmarks/step.py`'s own frames are step.py
SCRIPTS = {p.name for p in Path(__file__).resolve().parent.glob("*.py")}
ADDRESS = re.compile(r" (of .+ object )?at 0x[0-9a-f]+")  # builtins' objects and addresses differ between calls
NO_HOST = "(no host event)"
NO_PROJECT = "(no project frame)"


def is_project(name: str, cat: str) -> bool:
    if cat == "user_annotation":
        return name.startswith(PREFIX)
    m = FRAME.match(name) if cat == "python_function" else None
    if m is None:
        return False
    file = m[1]
    return "site-packages/" not in file and ("tandem/" in file or "benchmarks/" in file or file in SCRIPTS)


def union(intervals) -> tuple[list[float], list[float]]:
    """The union of (start, end) intervals sorted by start, as sorted disjoint starts and ends."""
    starts, ends = [], []
    for s, e in intervals:
        if ends and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(e)
    return starts, ends


class Thread:
    """One host thread's events sorted by start, an enclosing event before those it encloses, each with the
    innermost earlier event still open at its start: every event open at a time t is then an ancestor of the last
    event begun by t, so the stack at t is one bisect and a walk up."""

    def __init__(self, events: list[tuple[float, float, str, bool]]):
        events.sort(key=lambda e: (e[0], -e[1]))
        self.starts = [e[0] for e in events]
        self.ends = [e[1] for e in events]
        self.names = [e[2] for e in events]
        self.project = [e[3] for e in events]
        self.parent = []
        open_ = []
        for i, s in enumerate(self.starts):
            while open_ and self.ends[open_[-1]] <= s:
                open_.pop()
            self.parent.append(open_[-1] if open_ else -1)
            open_.append(i)
        self.busy_starts, self.busy_ends = union(zip(self.starts, self.ends))

    def active(self, t0: float, t1: float) -> bool:
        """Whether any event overlaps (t0, t1)."""
        i = bisect.bisect_left(self.busy_starts, t1) - 1
        return i >= 0 and self.busy_ends[i] > t0

    def stack(self, t: float) -> list[int]:
        """The events open at t, outermost first (every ancestor is checked: nesting in a trace is not exact)."""
        out = []
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0:
            if self.ends[i] >= t:
                out.append(i)
            i = self.parent[i]
        return out[::-1]


def load(path: str) -> tuple[list[tuple[float, float]], list[Thread], int]:
    """The device intervals sorted by start, the host threads, and the trace's event count."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    device, host = [], defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in DEVICE_CATS:
            ts = float(e["ts"])
            device.append((ts, ts + float(e.get("dur", 0))))
        elif cat in HOST_CATS:
            ts, name = float(e["ts"]), e.get("name", "")
            host[e.get("pid"), e.get("tid")].append((ts, ts + float(e.get("dur", 0)), name, is_project(name, cat)))
    device.sort()
    return device, [Thread(ev) for ev in host.values()], len(events)


def attribute(threads: list[Thread], t0: float, t1: float) -> tuple[list[str], str]:
    """The project frames (outermost first) and the innermost frame of the host thread at the gap's midpoint:
    among the threads with events in the gap, one in project code there, else one in any event, the one with
    the most events first (the engine's thread)."""
    mid = (t0 + t1) / 2
    best, best_key = None, None
    for th in threads:
        if not th.active(t0, t1):
            continue
        stack = th.stack(mid)
        key = (any(th.project[i] for i in stack), bool(stack), len(th.starts))
        if best_key is None or key > best_key:
            best, best_key = (th, stack), key
    if best is None or not best[1]:
        return [], NO_HOST
    th, stack = best
    return [th.names[i] for i in stack if th.project[i]], ADDRESS.sub("", th.names[stack[-1]])


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def summarize(path: str, min_us: float = 20, top: int = 25) -> str:
    """The device's busy and idle time over the window of its work, and the idle gaps of at least `min_us` by what
    the host ran during them: the `top` innermost project frames by idle time, then the 10 longest gaps."""
    device, threads, count = load(path)
    if not device:
        return (f"{path}: no device work (kernel, gpu_memcpy or gpu_memset events) among {count} trace events, "
                f"{sum(len(t.starts) for t in threads)} host events on {len(threads)} host thread(s): no gaps to "
                "attribute")
    starts, ends = union(device)
    window = ends[-1] - starts[0]
    busy = sum(e - s for s, e in zip(starts, ends))
    gaps = [(ends[i - 1], starts[i]) for i in range(1, len(starts)) if starts[i] - ends[i - 1] >= min_us]
    idle = defaultdict(float)
    n = Counter()
    deepest = defaultdict(Counter)
    longest = []
    for t0, t1 in gaps:
        frames, inner = attribute(threads, t0, t1)
        key = frames[-1] if frames else NO_PROJECT if inner != NO_HOST else NO_HOST
        idle[key] += t1 - t0
        n[key] += 1
        deepest[key][inner] += 1
        longest.append((t1 - t0, t0, " > ".join(frames) or key, inner))
    gap_us = sum(t1 - t0 for t0, t1 in gaps)
    out = [f"{path}: window {window / 1e3:.3f} ms (first to last device event), device busy {busy / 1e3:.3f} ms "
           f"({busy / window:.1%}), idle {(window - busy) / 1e3:.3f} ms; {len(threads)} host threads",
           f"gaps >= {min_us:g} us: {len(gaps)}, {gap_us / 1e3:.3f} ms ({gap_us / max(window - busy, 1e-9):.0%} of "
           f"the idle time)"]
    if not gaps:
        return "\n".join(out)
    out.append(f"{'idle ms':>9} {'gaps':>6}  {'innermost project frame':<72} innermost frame (most common)")
    for key in sorted(idle, key=idle.get, reverse=True)[:top]:
        inner, times = deepest[key].most_common(1)[0]
        out.append(f"{idle[key] / 1e3:>9.3f} {n[key]:>6}  {clip(key, 72):<72} {clip(inner, 50)} ({times}/{n[key]})")
    out.append("longest gaps (start from the window's, project frames outermost first, [innermost frame]):")
    out.append(f"{'start ms':>9} {'us':>7}  stack")
    for length, t0, stack, inner in sorted(longest, key=lambda g: g[0], reverse=True)[:10]:
        stack = stack if len(stack) <= 200 else "..." + stack[-197:]  # the innermost frames matter most
        out.append(f"{(t0 - starts[0]) / 1e3:>9.3f} {length:>7.0f}  {stack}  [{clip(inner, 60)}]")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a Chrome trace JSON file (or .json.gz) from torch.profiler's export_chrome_trace")
    ap.add_argument("--min-us", type=float, default=20.0, help="the shortest idle gap to attribute, microseconds")
    ap.add_argument("--top", type=int, default=25, help="how many innermost project frames to list")
    args = ap.parse_args()
    print(summarize(args.trace, args.min_us, args.top))


if __name__ == "__main__":
    main()
