"""Structured outputs (vLLM's `structured_outputs`): a request's constraint as a grammar, and the matchers that
follow it token by token, on llguidance.

llguidance because it installs as one abi3 wheel with no dependencies (xgrammar pulls torch, triton, transformers
and apache-tvm-ffi, so a machine without network needs all of them matched to its torch), and it builds a grammar's
lexer lazily, so a new schema costs little before its first mask.

    spec = grammar_spec(StructuredOutputs(json=schema))   # ValueError with the parser's message when invalid
    compiler = GrammarCompiler("models/tandem-tiny", vocab_size, eos_ids)
    matcher = compiler.matcher(params.structured_outputs)  # a fresh matcher over a cached compiled grammar

The router checks a constraint with `grammar_spec` (no vocabulary needed); a worker compiles it against the
model's tokenizer in its RPC thread, never on the engine thread. Compiled grammars are cached by their spec and
each request gets a copy of the cached matcher in its start state.
"""

from __future__ import annotations

import copy
import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_CACHED_GRAMMARS = 256


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint, as vLLM's StructuredOutputsParams: exactly one of json (a schema, as a JSON string),
    json_object, regex, choice, grammar (Lark or GBNF)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (compact JSON only)
    # the prompt opened the model's thinking: the constraint starts after `</think>` (and the blank lines after
    # it), as vLLM starts a thinking model's grammar once its reasoning parser sees the reasoning end
    after_think: bool = False
    # decode failover: the prompt's last `resumed_tokens` tokens are the output so far, generated elsewhere under
    # this constraint (the router re-places the request with them in its prompt); the matcher starts after them
    resumed_tokens: int = 0

    def __post_init__(self):
        if isinstance(self.json, (dict, bool)):  # a schema as Python values, as vLLM takes it
            object.__setattr__(self, "json", json.dumps(self.json))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {kinds or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if not isinstance(self.resumed_tokens, int) or self.resumed_tokens < 0:
            raise ValueError(f"structured_outputs.resumed_tokens must be >= 0, got {self.resumed_tokens}")


def grammar_spec(so: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint; ValueError with the parser's message when it is invalid."""
    spec = _spec(so.json, so.json_object, so.regex, so.choice, so.grammar, so.disable_any_whitespace)
    return _after_think(spec) if so.after_think else spec


# free text up to the first `</think>` (a lazy lexeme: the shortest match), then the constraint's own grammar
_THINK = 'start: think BLANK? @constraint\nthink[lazy]: /(?s:.*)<\\/think>/\nBLANK: /[ \\n]+/\n'


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _after_think(spec: str) -> str:
    grammars = json.loads(spec)["grammars"]
    grammars[0] = dict(grammars[0], name="constraint")
    return json.dumps({"grammars": [{"name": "think", "lark_grammar": _THINK}, *grammars]})


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _spec(schema, json_object, regex, choice, grammar, compact) -> str:
    import llguidance as llg

    if schema is not None or json_object:
        try:
            parsed = json.loads(schema) if schema is not None else {"type": "object"}
        except (ValueError, RecursionError) as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise ValueError("a JSON schema must be an object or a boolean")
        spec = llg.LLMatcher.grammar_from_json_schema(parsed, defaults={"whitespace_flexible": not compact})
    elif regex is not None:
        spec = llg.LLMatcher.grammar_from_regex(regex)
    elif choice is not None:
        spec = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choice))
    else:
        try:
            spec = llg.grammar_from("grammar", grammar)  # Lark, or GBNF converted to it
        except ValueError as e:
            raise ValueError(f"invalid grammar: {e}") from None
    error = llg.LLMatcher.validate_grammar(spec)
    if error:
        what = "JSON schema" if schema is not None else "regex" if regex is not None else "grammar"
        raise ValueError(f"invalid {what}: {error.strip()}")
    return spec


class GrammarCompiler:
    """Matchers for one model's vocabulary. Thread-safe: RPC threads compile while the engine thread steps."""

    def __init__(self, model: str | None, vocab_size: int, eos_ids: list[int], tokenizer=None):
        self.model, self.vocab_size, self.eos_ids = model, vocab_size, list(eos_ids)
        self._tokenizer, self._ll_tokenizer = tokenizer, None
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def _ll(self):
        """The llguidance tokenizer (built on first use: a 248k vocabulary takes about a second)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = _ll_tokenizer(self._tokenizer or _load(self.model), self.vocab_size,
                                                   self.eos_ids)
            return self._ll_tokenizer

    def matcher(self, so: StructuredOutputs, prompt_token_ids: list[int] = ()):
        """A matcher in its start state, or after the prompt's last `so.resumed_tokens` tokens; ValueError when
        the constraint does not compile or refuses those tokens."""
        import llguidance as llg

        spec = grammar_spec(so)
        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return _resumed(template.deep_copy(), so, prompt_token_ids)
        template = llg.LLMatcher(self._ll(), spec, log_level=0)  # outside the lock: it may take a while
        if template.is_error():
            raise ValueError(f"invalid structured output constraint: {template.get_error()}")
        with self._lock:
            self._templates[spec] = template
            while len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return _resumed(template.deep_copy(), so, prompt_token_ids)


def _resumed(matcher, so: StructuredOutputs, prompt_token_ids):
    n = so.resumed_tokens
    if n:
        if n > len(prompt_token_ids):
            raise ValueError(f"structured_outputs.resumed_tokens ({n}) exceeds the prompt ({len(prompt_token_ids)} "
                             "tokens)")
        if not matcher.consume_tokens(list(prompt_token_ids[-n:])):
            raise ValueError("structured_outputs: the resumed tokens do not follow the constraint: "
                             f"{matcher.get_error().splitlines()[0]}")
    return matcher


def _load(model: str | None):
    from tandem.tokenizer import load_tokenizer_for

    tok = load_tokenizer_for(model) if model is not None else None
    if tok is None:
        raise ValueError("structured outputs need the model's tokenizer, and this model has none")
    return tok


def _ll_tokenizer(tok, vocab_size: int, eos_ids: list[int]):
    import llguidance as llg

    enc = getattr(tok, "_enc", None)  # the presets' Qwen3.5 vocabulary is a tiktoken encoding
    if enc is not None:
        from llguidance.tiktoken import lltokenizer_from_encoding

        return lltokenizer_from_encoding(enc, n_vocab=vocab_size, eos_token=eos_ids)
    backend = copy.copy(tok.backend_tokenizer)  # as llguidance.hf: the vocabulary without padding or truncation
    backend.no_padding()
    backend.no_truncation()
    return llg.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_ids)
