"""Where a serving worker's engine thread spent its time, from py-spy's raw samples (`py-spy record --threads
--idle -f raw`, as `benchmarks/h200_session.sh serve` takes them with SPY=seconds): each sample of the engine
thread goes to the first phase whose function is on its stack, and the GDN and attention cores are counted inside
a mixed step's launch. With a `--gil` file too, who held the GIL: the engine thread or the server's threads.

    python3 benchmarks/spy_report.py IDLE_RAW [GIL_RAW]
    python3 benchmarks/spy_report.py --thread MainThread OFFLINE_RAW   # benchmarks/offline.py's engine, unserved
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

ENGINE_THREAD = "engine-loop"
# (phase, a function on the stack), first match wins: the decode graphs' wait for their result, a mixed (or eager)
# step's forward launch, its wait for the verify rows' tokens, the MTP drafting, the idle loop
PHASES = (
    ("decode step: waiting on the device", "DecodeGraphs.accept_and_draft"),
    ("decode step: host work beside the wait", "Engine._decode"),
    ("mixed step: launching the forward", "ModelRunner.forward"),
    ("mixed step: waiting for the verify rows", "Engine._verified"),
    ("mixed step: first tokens of finished prompts", "Engine._prefilled"),
    ("mixed step: drafting", "Engine._draft"),
    ("idle: no work", "Condition.wait"),
)
CORES = (("GDN cores", "GatedDeltaNet.recurrence"), ("attention cores", "GatedAttention.attend"))
_FRAME = re.compile(r"^(\S+) \(")  # "function (file:line)" -> function


def samples(path: str):
    """(thread, [function, ...] from the thread's root, count) of each line of a raw py-spy file."""
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            thread, *frames = stack.split(";")
            yield thread, [m.group(1) if (m := _FRAME.match(fr)) else fr for fr in frames], int(count)


def engine_phases(path: str, engine_thread: str = ENGINE_THREAD) -> tuple[Counter, Counter, int]:
    """The engine thread's samples by phase, the cores' samples inside the forward launches, and the total."""
    phases, cores, total = Counter(), Counter(), 0
    for thread, functions, n in samples(path):
        if engine_thread not in thread:
            continue
        total += n
        on_stack = set(functions)
        phase = next((name for name, fn in PHASES if fn in on_stack), "other")
        phases[phase] += n
        if phase == "mixed step: launching the forward":
            for name, fn in CORES:
                cores[name] += n if fn in on_stack else 0
    return phases, cores, total


# the other threads by what they serve (a function on the stack, first match wins); the rest by their leaf function
SERVER_THREADS = (
    ("server: Decode streams", "DecodeWorker.Decode"),
    ("server: Attach streams", "DecodeWorker.Attach"),
    ("server: Prefill calls", "DecodeWorker.Prefill"),
    ("server: Reserve calls", "DecodeWorker.Reserve"),
    ("server: streamed responses (sending)", "_stream_response_in_pool"),
    ("server: unary calls (sending)", "_unary_response_in_pool"),
    ("server: gRPC's polling thread", "_serve"),
    ("server: gRPC's handler dispatch", "_handle_call"),
)


def gil_holders(path: str, engine_thread: str = ENGINE_THREAD) -> Counter:
    holders = Counter()
    for thread, functions, n in samples(path):
        if engine_thread in thread:
            holders["engine thread"] += n
            continue
        on_stack = set(functions)
        leaf = functions[-1] if functions else "?"
        holders[next((name for name, fn in SERVER_THREADS if fn in on_stack), f"other: {leaf}")] += n
    return holders


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("idle", help="py-spy raw output recorded with --threads --idle")
    ap.add_argument("gil", nargs="?", help="py-spy raw output recorded with --threads --gil")
    ap.add_argument("--thread", default=ENGINE_THREAD, help="the engine's thread (default: a serving worker's)")
    a = ap.parse_args()
    phases, cores, total = engine_phases(a.idle, a.thread)
    print(f"engine thread: {total} samples")
    for name, n in phases.most_common():
        print(f"  {name:<46} {n:>6} {n / max(1, total):>6.1%}")
    launch = phases["mixed step: launching the forward"]
    for name, n in cores.items():
        print(f"    of the forward launches, {name:<20} {n:>6} {n / max(1, launch):>6.1%}")
    if a.gil:
        holders = gil_holders(a.gil, a.thread)
        held = sum(holders.values())
        print(f"GIL held in {held} samples")
        for name, n in holders.most_common(12):
            print(f"  {name:<46} {n:>6} {n / max(1, held):>6.1%}")


if __name__ == "__main__":
    main()
