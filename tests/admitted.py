"""A request placed straight into an engine's running batch with blocks for its whole length (prompt + max_tokens +
the k draft rows), for tests that run the model on its rows by hand (`runner.run`, `build_batch`) instead of
through `Engine.step`, which would grow its blocks step by step."""

from tandem.engine.sampling_params import SamplingParams
from tandem.engine.sequence import Sequence, Status


def admitted(engine, request_id: str, ids, max_tokens: int = 16) -> Sequence:
    seq = Sequence(request_id, list(ids), SamplingParams(max_tokens=max_tokens))
    sched = engine.scheduler
    sched.add(seq)
    sched.waiting.remove(seq)
    assert sched._allocate(seq, len(seq.prompt_token_ids) + max_tokens), "no room for the request"
    seq.status = Status.RUNNING
    sched.running.append(seq)
    return seq
