"""EngineLoop's deferred hand-offs: what `after_step` defers runs once the next step has launched its forward
(`Engine.on_launch`), or before a queued call, or when the loop goes idle -- never lost, never reordered."""

import threading
import time
from types import SimpleNamespace

import torch

from tandem.config import EngineConfig
from tandem.engine.engine import Engine
from tandem.engine.loop import EngineLoop
from tandem.engine.sampling_params import SamplingParams
from tandem.model.presets import preset_config, random_model


class FakeEngine:
    """Runs `steps` steps; each records its launch and its end around the `on_launch` hook, as Engine.step does."""

    def __init__(self, steps: int, launch: bool = True):
        self.left, self.launch, self.events, self.last_step = steps, launch, [], None
        self.on_launch, self.scheduler = None, SimpleNamespace(running=[], waiting=[])

    def has_work(self) -> bool:
        return self.left > 0

    def step(self):
        i = self.left
        self.events.append(("launched", i))
        if self.launch:
            self.on_launch()
        self.events.append(("waited", i))
        self.left -= 1
        return []


def run(eng: FakeEngine, last_event, on_loop=None) -> None:
    """Runs a loop whose after_step defers ("out", i) for step i, until `last_event` shows (at most 10 s)."""
    loop = EngineLoop(eng, lambda active, finished: loop.defer(eng.events.append, ("out", eng.left + 1)),
                      lambda exc, active: None, idle_wait=0.01)
    loop.start()
    if on_loop is not None:
        loop.call(lambda engine: on_loop(loop))
    deadline = time.monotonic() + 10
    while last_event not in eng.events and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()


def test_outputs_go_out_while_the_next_step_runs_and_the_last_when_idle():
    eng = FakeEngine(3)
    run(eng, ("out", 1))
    assert eng.events == [("launched", 3), ("waited", 3),
                          ("launched", 2), ("out", 3), ("waited", 2),
                          ("launched", 1), ("out", 2), ("waited", 1),
                          ("out", 1)]  # the last step's, once the loop has nothing left to run


def test_a_step_that_launches_nothing_still_lets_the_earlier_outputs_out_in_order():
    eng = FakeEngine(2, launch=False)  # the hook never fires: each step's end lets the earlier outputs out
    run(eng, ("out", 1))
    assert eng.events == [("launched", 2), ("waited", 2), ("launched", 1), ("waited", 1), ("out", 2), ("out", 1)]


def test_a_queued_call_runs_after_the_outputs_deferred_before_it():
    eng = FakeEngine(0)

    def defer_then_call(loop):  # on the loop thread, as after_step would
        loop.defer(eng.events.append, "out")
        loop.submit(lambda engine: eng.events.append("call"))

    run(eng, "call", on_loop=defer_then_call)
    assert eng.events == ["out", "call"]


def test_the_engine_hands_outputs_over_once_its_whole_forward_is_launched():
    """The hook fires once per step, after the forward (of prompt chunks, decode rows or both) has been launched,
    which is when `ModelRunner.forward` has advanced every chunk's computed rows, and before the step's tokens."""
    cfg = preset_config("tiny-moe")
    eng = Engine(cfg, random_model(cfg, "cpu", torch.float32),
                 EngineConfig(block_size=4, max_model_len=64, max_num_batched_tokens=12, num_speculative_tokens=2,
                              enable_prefix_caching=False))  # one chunk a prompt: no snapshot point inside it
    seen = []

    def hook():
        seqs = list(eng.sequences.values())
        seen.append(([s.num_computed for s in seqs], [len(s.output_token_ids) for s in seqs]))

    eng.on_launch = hook
    eng.add_request("a", list(range(2, 12)), SamplingParams(max_tokens=4, ignore_eos=True))
    kinds = []
    for _ in range(3):
        before = [(s.num_computed, len(s.output_token_ids)) for s in eng.sequences.values()]
        eng.step()
        if eng.last_step.decodes == 0:  # "a" alone prefills: its 10 prompt rows fit the budget of 12
            eng.add_request("b", list(range(3, 15)), SamplingParams(max_tokens=4, ignore_eos=True))
        kinds.append(eng.last_step.kind)
        computed, outputs = seen[-1]
        assert len(seen) == len(kinds)  # once a step
        assert outputs == [n for _, n in before][: len(outputs)]  # no token of this step yet
        assert all(c > b for c, (b, _) in zip(computed, before))  # every scheduled chunk launched
    assert kinds[:2] == ["prefill", "mixed"]


def test_the_loop_thread_carries_its_name_in_the_os():
    """Per-thread CPU figures (/proc, top -H, benchmarks/cpu_use.py) can tell the engine's thread apart."""
    loop = EngineLoop(FakeEngine(0), lambda active, finished: None, lambda exc, active: None, idle_wait=0.01).start()
    try:
        comm = loop.call(lambda engine: open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip(),
                         timeout=10)
    finally:
        loop.stop()
    assert comm == "engine-loop"
