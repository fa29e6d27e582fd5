"""Incremental detokenization with stop strings.

    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, stop=["\\n\\n"])
    for ids in stream:
        delta, stopped = detok.add(ids)
        ...
        if stopped: break          # detok.stop_reason is the stop string that matched
    tail = detok.flush()           # at the end of generation (not needed after a stop)

Text: decoding the whole output at every step is quadratic, and decoding token by token breaks characters that
span tokens (byte-fallback, byte-level BPE) and tokenizers whose decode depends on the neighbour (SentencePiece's
leading-space rule). So each step decodes a short window: the tokens already emitted since the last boundary
(`prefix`) plus the new ones, and emits what the new ones add, once it does not end in an incomplete character
(U+FFFD). The concatenated deltas then equal the full decode, and no delta carries a broken character that the
full text does not have.

Stop strings: the earliest point in the text where any stop string is complete ends the output; the text up to
the start of that stop string is emitted (the stop string itself is not, unless `include_stop_str_in_output`).
Text that could still be the beginning of a stop string is held back until the next tokens decide.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class StopMatcher:
    """Stop strings over a stream of text deltas; `feed(text) -> (released, stopped)`, `flush() -> held text`."""

    def __init__(self, stop: list[str] | tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self.held = ""
        self.stopped = False
        self.stop_reason: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self.held + text
        if not self.stop:
            self.held = ""
            return buf, False
        best = None  # (end, start, stop): the stop string completed first; the longest of those ending together
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            end, start, s = best
            self.stopped, self.stop_reason, self.held = True, s, ""
            return buf[:end] if self.include else buf[:start], True
        hold = 0  # the longest tail of buf that begins some stop string
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


class IncrementalDetokenizer:
    """Text deltas for a growing list of generated token ids (see the module docstring)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False):
        stop = [s for s in (stop or ()) if s]
        if tokenizer is None and stop:
            raise ValueError("stop strings need a tokenizer: this model has none (use stop_token_ids)")
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: a boundary one emission back, for the neighbour-dependent decoders
        self.read = 0  # ids before this are emitted
        self.matcher = StopMatcher(stop, include_stop_str_in_output)
        self.text = ""  # everything emitted so far

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def stop_reason(self) -> str | None:
        return self.matcher.stop_reason

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def _new_text(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        full = self._decode(self.ids[self.prefix:])
        if len(full) <= len(prefix_text) and not final:
            return ""  # nothing visible yet (a special token skipped, or a character still incomplete)
        if full.endswith(REPLACEMENT) and not final:
            return ""  # the last character is incomplete: wait for the bytes that finish it
        delta = full[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        return delta

    def add(self, token_ids) -> tuple[str, bool]:
        """Appends generated ids; returns (text released by them, whether a stop string has matched)."""
        if self.tok is None or self.stopped:
            self.ids.extend(token_ids)
            return "", self.stopped
        self.ids.extend(int(t) for t in token_ids)
        out, stopped = self.matcher.feed(self._new_text(final=False))
        self.text += out
        return out, stopped

    def flush(self) -> str:
        """At the end of generation: whatever is still held (an incomplete character decodes to U+FFFD then)."""
        if self.tok is None or self.stopped:
            return ""
        out, stopped = self.matcher.feed(self._new_text(final=True))
        if not stopped:
            out += self.matcher.flush()
        self.text += out
        return out
