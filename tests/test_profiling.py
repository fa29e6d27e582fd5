"""The engine's named ranges (tandem/profiling.py): steps under torch's profiler record each phase, nested as the
engine runs them, so a trace without Python stacks still says where the host was; and the ranges change nothing
the engine computes."""

from torch.profiler import ProfilerActivity, profile

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

PROMPTS = {"a": [5, 9, 2, 7, 3], "b": [4, 1]}


def _run(profiled: bool):
    """Three steps of two requests (their prompts, then verify steps with k = 2) -> (their tokens, the ranges)."""
    llm = LLM(model="tiny-moe", max_num_seqs=2, max_model_len=64, block_size=4,
              speculative_config={"num_speculative_tokens": 2})
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    for rid, ids in PROMPTS.items():
        llm.engine.add_request(rid, ids, params)
    if profiled:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                llm.engine.step()
        ranges = [e for e in prof.events() if e.name.startswith("tandem.")]
    else:
        for _ in range(3):
            llm.engine.step()
        ranges = []
    return {rid: list(llm.engine.sequences[rid].output_token_ids) for rid in PROMPTS}, ranges


def _inside(e, outer) -> bool:
    return any(o.time_range.start <= e.time_range.start and e.time_range.end <= o.time_range.end for o in outer)


def test_steps_record_their_phases_and_compute_the_same():
    tokens, ranges = _run(profiled=True)
    names = {e.name for e in ranges}
    assert {"tandem.Engine.step", "tandem.Scheduler.schedule", "tandem.ModelRunner.forward",
            "tandem.ModelRunner.rows_batch", "tandem.sample", "tandem.Engine._prefilled", "tandem.Engine._verified",
            "tandem.Engine._draft", "tandem.core.recurrence", "tandem.core.attend"} <= names, names
    steps = [e for e in ranges if e.name == "tandem.Engine.step"]
    assert len(steps) == 3
    assert all(_inside(e, steps) for e in ranges)
    # the target's cores run inside its forward, the MTP head's inside the drafting
    outer = [e for e in ranges if e.name in ("tandem.ModelRunner.forward", "tandem.Engine._draft")]
    assert all(_inside(e, outer) for e in ranges if e.name.startswith("tandem.core."))
    assert all(len(t) >= 2 for t in tokens.values())  # the verify steps emitted tokens
    assert _run(profiled=False)[0] == tokens
