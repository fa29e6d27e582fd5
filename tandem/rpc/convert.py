"""Between the wire messages and the engine's types: sampling parameters, logprobs, finish reasons."""

from __future__ import annotations

from tandem.engine.sampling_params import SamplingParams
from tandem.rpc import common_pb2
from tandem.structured import StructuredOutputs

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take vLLM's defaults; raises ValueError (with the field named) for a bad value."""
    defaults = SamplingParams()

    def opt(name):
        return getattr(m, name) if m.HasField(name) else getattr(defaults, name)

    return SamplingParams(
        max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_k=m.top_k, top_p=opt("top_p"),
        min_p=m.min_p, seed=m.seed if m.HasField("seed") else None, repetition_penalty=opt("repetition_penalty"),
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        logprobs=m.logprobs if m.HasField("logprobs") else None, stop_token_ids=list(m.stop_token_ids),
        ignore_eos=m.ignore_eos, min_tokens=m.min_tokens,
        prompt_logprobs=m.prompt_logprobs if m.HasField("prompt_logprobs") else None,
        structured_outputs=structured_from_proto(m.structured_outputs) if m.HasField("structured_outputs") else None)


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    m = common_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos,
        min_tokens=p.min_tokens)
    if p.seed is not None:
        m.seed = p.seed
    if p.logprobs is not None:
        m.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        m.prompt_logprobs = p.prompt_logprobs
    if p.structured_outputs is not None:
        m.structured_outputs.CopyFrom(structured_to_proto(p.structured_outputs))
    return m


def structured_from_proto(m: common_pb2.StructuredOutputs) -> StructuredOutputs:
    """ValueError when no constraint is set (the constraint itself is checked when it is compiled)."""
    kind = m.WhichOneof("constraint")
    if kind is None:
        raise ValueError("structured_outputs: set one of json, json_object, regex, choice, grammar")
    value = list(m.choice.choices) if kind == "choice" else getattr(m, kind)
    return StructuredOutputs(**{kind: value}, disable_any_whitespace=m.disable_any_whitespace,
                             after_think=m.after_think, resumed_tokens=m.resumed_tokens)


def structured_to_proto(so: StructuredOutputs) -> common_pb2.StructuredOutputs:
    m = common_pb2.StructuredOutputs(disable_any_whitespace=so.disable_any_whitespace, after_think=so.after_think,
                                     resumed_tokens=so.resumed_tokens)
    if so.choice is not None:
        m.choice.choices.extend(so.choice)
    elif so.json_object:
        m.json_object = True
    else:
        for kind in ("json", "regex", "grammar"):
            if getattr(so, kind) is not None:
                setattr(m, kind, getattr(so, kind))
    return m


def logprobs_to_proto(d: dict[int, float] | None) -> common_pb2.TokenLogprobs:
    d = d or {}
    return common_pb2.TokenLogprobs(token_ids=list(d), logprobs=list(d.values()))


def prompt_logprobs_to_proto(entries: list[dict[int, float] | None]) -> list[common_pb2.TokenLogprobs]:
    """A sequence's `prompt_logprobs` (None first, then a dict per prompt token; empty when not asked for) as the
    wire carries them: one entry per prompt token after the first."""
    return [logprobs_to_proto(d) for d in entries[1:]]


FINISH_REASON_NAMES = {code: name for name, code in FINISH_REASONS.items()}


def finish_reason_name(code: int) -> str | None:
    """The wire enum as vLLM/OpenAI spell it ("stop", "length", "abort"); None while unfinished."""
    return FINISH_REASON_NAMES.get(code)


def finish_reason_to_proto(reason: str | None) -> int:
    return FINISH_REASONS.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED) if reason else 0


def load_of(engine, **extra) -> common_pb2.Load:
    """A worker's Load as the router sees it: requests and free capacity of its engine (plus role extras)."""
    sched, pools, bs = engine.scheduler, engine.pools, engine.ecfg.block_size
    return common_pb2.Load(running_requests=len(sched.running), waiting_requests=len(sched.waiting),
                           free_kv_blocks=pools.blocks.num_free, total_kv_blocks=pools.blocks.capacity,
                           free_kv_tokens=pools.blocks.num_free * bs, total_kv_tokens=pools.blocks.capacity * bs,
                           free_state_slots=pools.slots.num_free, total_state_slots=pools.slots.capacity,
                           max_model_len=engine.ecfg.max_model_len, **extra)
