"""Request bodies of the HTTP endpoint: JSON parsing with bounds, and the type and range checks of each OpenAI field.

Every value that reaches protobuf or the tokenizer is checked here, so bad input is a 400 naming the field instead
of an exception deeper down: integers within the proto field's type, finite floats, strings that are valid Unicode
(JSON's "\\ud800" escapes decode to lone surrogates, which neither protobuf nor the tokenizers can encode) and a
bounded nesting depth. These run on the CPU pool (router/cpu_pool.py): a large body takes a while to walk.
"""

from __future__ import annotations

import json
import math

from router.http_errors import bad
from tandem.rpc import common_pb2

MAX_N = 128
MAX_LOGPROBS = 20
MAX_DEPTH = 64  # JSON nesting; OpenAI bodies need a handful of levels (messages[i].content[j].text)
U32 = 2**32
FLOAT32_MAX = 3.4028234663852886e38

_NUM = (int, float)


# ---- the body as a whole ------------------------------------------------------------------------------------------
def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, or a 400: not JSON, not an object, nested too deeply, or holding a string
    that is not valid Unicode."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad(f"the request body is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError, invalid UTF-8, an integer of > 4300 digits
        raise bad("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_json(body)
    return body


def check_json(body: dict) -> None:
    """Walks the parsed body once (iteratively: no recursion on hostile input): depth, and every key and string
    valid Unicode. The error names the top-level field (OpenAI's `param`) and the path within it."""
    stack = [(v, k, [k], 1) for k, v in body.items()]
    _check_str(list(body), None, [])
    while stack:
        v, top, path, depth = stack.pop()
        if isinstance(v, str):
            _check_str([v], top, path)
        elif isinstance(v, (list, dict)):
            if depth >= MAX_DEPTH:
                raise bad(f"'{_path(path)}' is nested too deeply (at most {MAX_DEPTH} levels)", top)
            if isinstance(v, dict):
                _check_str(list(v), top, path)
                stack.extend((x, top, path + [k], depth + 1) for k, x in v.items() if isinstance(x, (str, list, dict)))
            else:
                stack.extend((x, top, path + [i], depth + 1) for i, x in enumerate(v)
                             if isinstance(x, (str, list, dict)))


def _check_str(strings: list[str], top: str | None, path: list) -> None:
    for s in strings:
        if s.isascii():
            continue
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            where = f"'{_path(path)}'" if path else "a field name"
            raise bad(f"{where} is not valid Unicode (a lone surrogate at character {e.start})",
                      top if top is not None else s.encode("utf-8", "replace").decode()) from None


def _path(path: list) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return _short(out, quote=False)


# ---- single fields ------------------------------------------------------------------------------------------------
def field(body: dict, name: str, kinds, default=None, check=None, why: str = ""):
    """body[name] when present and not null, type-checked (bool is not a number here); else `default`."""
    v = body.get(name)
    if v is None:
        return default
    is_bool = isinstance(v, bool)
    if (bool in kinds) != is_bool or not isinstance(v, kinds):
        raise bad(f"'{name}' has the wrong type: {type(v).__name__}", name)
    if check is not None and not check(v):
        raise bad(f"'{name}' {why}, got {_short(v)}", name)
    return v


def integer(body: dict, name: str, lo: int, hi: int, default=None, why: str | None = None):
    """An integer field in [lo, hi)."""
    return field(body, name, (int,), default, lambda v: lo <= v < hi, why or f"must be in [{lo}, {hi - 1}]")


def number(body: dict, name: str, check, why: str, default=None):
    """A float field (an integer is accepted): finite within float32, then `check`."""
    return field(body, name, _NUM, default, lambda v: _float32(v) and check(v), why)


def _float32(v) -> bool:
    try:
        return math.isfinite(v) and abs(float(v)) <= FLOAT32_MAX
    except OverflowError:  # an integer past float's range
        return False


def _short(v, quote: bool = True, limit: int = 60) -> str:
    s = repr(v) if quote else v
    return s if len(s) <= limit else s[:limit - 3] + "..."


def token_ids(x) -> bool:
    """A list of token ids as protobuf's uint32 takes them (the router checks them against the vocabulary)."""
    return isinstance(x, list) and all(type(t) is int and 0 <= t < U32 for t in x)


def sampling(body: dict, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
    """Only what the client set: the router applies vLLM's defaults to the rest."""
    s = common_pb2.SamplingParams()
    if max_tokens is not None:
        s.max_tokens = max_tokens
    if (t := number(body, "temperature", lambda v: 0 <= v <= 2, "must be in [0, 2]")) is not None:
        s.temperature = t
    if (p := number(body, "top_p", lambda v: 0 < v <= 1, "must be in (0, 1]")) is not None:
        s.top_p = p
    top_k = integer(body, "top_k", -1, U32, 0, f"must be -1, 0 (disabled) or in [1, {U32 - 1}]")
    s.top_k = max(top_k, 0)
    s.min_p = number(body, "min_p", lambda v: 0 <= v <= 1, "must be in [0, 1]", 0.0)
    if (seed := integer(body, "seed", -2**63, 2**63)) is not None:
        s.seed = seed
    for name in ("presence_penalty", "frequency_penalty"):
        setattr(s, name, number(body, name, lambda v: -2 <= v <= 2, "must be in [-2, 2]", 0.0))
    if (r := number(body, "repetition_penalty", lambda v: v > 0, "must be > 0")) is not None:
        s.repetition_penalty = r
    if logprobs is not None:
        s.logprobs = logprobs
    ids = field(body, "stop_token_ids", (list,), [])
    if not token_ids(ids):
        raise bad(f"'stop_token_ids' must be a list of integers in [0, {U32 - 1}]", "stop_token_ids")
    s.stop_token_ids.extend(ids)
    s.ignore_eos = field(body, "ignore_eos", (bool,), False)
    s.min_tokens = integer(body, "min_tokens", 0, U32, 0)
    return s


def stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad("'stop' must be a string or a list of strings", "stop")


def max_tokens(body: dict, names: tuple[str, ...], least: int = 1) -> int | None:
    for name in names:
        v = integer(body, name, least, U32, why=f"must be in [{least}, {U32 - 1}]")
        if v is not None:
            return v
    return None


def prompts(prompt) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, a list of token ids, or a list of either."""
    def ids(x):
        return isinstance(x, list) and x and token_ids(x)

    if isinstance(prompt, str) or ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt):
        return prompt
    raise bad(f"'prompt' must be a string, a list of token ids (integers in [0, {U32 - 1}]), or a non-empty list of "
              "those", "prompt")


def unsupported(body: dict, names: dict) -> None:
    for name, ok in names.items():
        if name in body and body[name] not in (None, *ok):
            raise bad(f"'{name}' is not supported by this server", name)
