"""benchmarks/trace_gaps.py against a hand-built Chrome trace whose gaps and host stacks are known: each idle gap of
the device goes to the innermost Tandem frame the engine's thread was in at the gap's midpoint."""

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from trace_gaps import summarize  # noqa: E402

T0 = 1_000_000.0  # absolute microseconds, as real traces have


def _recorder(ev: list):
    """x(cat, name, start, end, tid): appends a complete event, times in microseconds from T0; kernels on pid 9."""

    def x(cat, name, ts, end, tid=1):
        ev.append({"ph": "X", "cat": cat, "name": name, "pid": 9 if cat == "kernel" else 1, "tid": tid,
                   "ts": T0 + ts, "dur": end - ts})

    return x


def _trace() -> dict:
    ev = []
    x = _recorder(ev)

    # the engine's thread: a step that schedules, then runs a forward with a GDN core inside
    x("python_function", "tandem/engine/llm.py(274): step", 0, 1000)
    x("python_function", "tandem/engine/scheduler.py(97): schedule", 10, 200)
    x("python_function", "<built-in method sort of list object at 0x7f00aa>", 50, 190)
    x("python_function", "tandem/engine/runner.py(61): forward", 200, 1000)
    x("python_function", "tandem/ops/gdn.py(480): gated_delta_rule_fla", 300, 700)
    x("cpu_op", "aten::copy_", 320, 380)
    # a second thread, busy all along outside project code: it must not take the gaps from the engine's
    x("python_function", "threading.py(1000): run", 0, 1000, tid=2)
    # the device: idle 40-210 (scheduling), 250-400 (fla, midpoint 325 in aten::copy_), 450-800 (fla, then the
    # forward after it: midpoint 625 still in fla) and a 5 us gap too short to count
    for a, b in [(0, 40), (210, 250), (400, 450), (800, 900), (905, 950)]:
        x("kernel", f"k{a}", a, b, tid=7)
    return {"traceEvents": ev}


def test_gaps_go_to_the_innermost_project_frame(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    text = summarize(str(path), min_us=20)
    head, _, rest = text.partition("\n")
    assert "window 0.950 ms" in head and "device busy 0.275 ms" in head and "idle 0.675 ms" in head
    assert "gaps >= 20 us: 3, 0.670 ms" in rest
    rows = {line.split()[2]: line.split()[:2] for line in rest.splitlines() if line.strip()[:1].isdigit()}
    assert rows["tandem/ops/gdn.py(480):"] == ["0.500", "2"]  # 150 + 350 us
    assert rows["tandem/engine/scheduler.py(97):"] == ["0.170", "1"]
    # the innermost frame of all: the builtin, its address dropped; the aten op under fla's first gap
    assert "<built-in method sort> (1/1)" in rest
    longest = rest.split("longest gaps")[1]
    assert "tandem/engine/llm.py(274): step > tandem/engine/runner.py(61): forward > tandem/ops/gdn.py(480)" in longest


def test_no_device_work(tmp_path):
    path = tmp_path / "t.json"
    trace = _trace()
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e["cat"] != "kernel"]
    path.write_text(json.dumps(trace))
    assert "no device work" in summarize(str(path))


def test_named_ranges_are_project_frames(tmp_path):
    """A trace without Python stacks: the engine's named ranges (tandem/profiling.py) take the gaps; other
    annotations (the profiler's own step ranges) do not."""
    ev = []
    x = _recorder(ev)
    x("user_annotation", "ProfilerStep#0", 0, 1000)
    x("user_annotation", "tandem.Engine.step", 0, 1000)
    x("user_annotation", "tandem.Scheduler.schedule", 10, 200)
    x("user_annotation", "tandem.core.recurrence", 300, 700)
    x("cpu_op", "aten::empty", 500, 520)
    x("user_annotation", "tandem.sample", 800, 990)
    for a, b in [(0, 40), (210, 400), (450, 800), (960, 1000)]:  # idle 40-210, 400-450, 800-960
        x("kernel", f"k{a}", a, b, tid=7)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    rest = summarize(str(path), min_us=20).partition("\n")[2]
    table = rest.split("longest gaps")[0]
    rows = {line.split()[2]: line.split()[:2] for line in table.splitlines() if line.strip()[:1].isdigit()}
    assert rows == {"tandem.Scheduler.schedule": ["0.170", "1"], "tandem.core.recurrence": ["0.050", "1"],
                    "tandem.sample": ["0.160", "1"]}
    assert "tandem.Engine.step > tandem.core.recurrence" in rest.split("longest gaps")[1]
