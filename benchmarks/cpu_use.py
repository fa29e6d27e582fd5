"""CPU time of processes and their threads over a window, from /proc: which threads of a serving run (the decode
worker's engine thread and server threads, the router, the benchmark client) keep cores busy, and whether the host
has cores to spare (an engine's thread is named `engine-loop` in the OS too). `h200_session.sh serve` runs it
with CPU=seconds.

    python3 benchmarks/cpu_use.py --seconds 5 PID [PID ...]
"""

from __future__ import annotations

import argparse
import os
import time


def _threads(pid: int) -> dict[tuple[int, str], float] | None:
    """(tid, name) -> CPU seconds so far (user + system) of each thread of the process; None once it has ended."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[(int(tid), name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return "(ended)"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pids", type=int, nargs="+")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=5, help="threads listed per process")
    args = ap.parse_args()
    cmds = {pid: _cmdline(pid) for pid in args.pids}
    before = {pid: _threads(pid) for pid in args.pids}
    t0 = time.monotonic()
    time.sleep(args.seconds)
    after = {pid: _threads(pid) for pid in args.pids}
    wall = time.monotonic() - t0
    print(f"CPU use over {wall:.1f} s ({os.cpu_count()} cores here); 100% = one core busy all the time")
    for pid in args.pids:
        if before[pid] is None or after[pid] is None:  # its threads' times go with it
            print(f"pid {pid}: ended before the window did  {cmds[pid]}")
            continue
        used = {t: s - before[pid].get(t, 0.0) for t, s in after[pid].items()}
        total = sum(used.values())
        print(f"pid {pid}: {total / wall:6.1%} over {len(used)} threads  {cmds[pid]}")
        for (tid, name), s in sorted(used.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"    {s / wall:6.1%}  {name} ({tid})")


if __name__ == "__main__":
    main()
