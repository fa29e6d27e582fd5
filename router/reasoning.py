"""Qwen3's thinking text, split from the answer: what a model writes between `<think>` and `</think>` is the
reasoning (OpenAI-compatible servers return it as `reasoning_content`), what follows `</think>` is the content.

    p = ReasoningParser(prompt_in_think=prompt_opens_think(prompt_text))
    reasoning, content = p.feed(piece)   # for each piece of the output, split anywhere
    reasoning, content = p.finish()      # at the end: whatever was held back

Qwen3.5's chat template ends the generation prompt with `<think>\\n` when thinking is on, so the output starts inside
the thinking without an opening tag; with thinking off it writes an empty think block into the prompt and all the
output is content. Which case applies is read from the rendered prompt, not guessed from the output. A model whose
prompt does not open the thinking may still start its output with `<think>` (Qwen3 templates that leave it to the
model): that opening tag is honoured at the very start of the output only. Thinking that never closes (the output
ran out of tokens) stays reasoning.
"""

from __future__ import annotations

from router.tag_scan import partial_tag

OPEN, CLOSE = "<think>", "</think>"
_START, _THINK, _CONTENT = "start", "think", "content"


def prompt_opens_think(prompt: str) -> bool:
    """Whether the rendered prompt leaves the model inside a think block (it ends with `<think>` and whitespace)."""
    return prompt.rstrip().endswith(OPEN)


class ReasoningParser:
    def __init__(self, prompt_in_think: bool):
        self._state = _THINK if prompt_in_think else _START
        self._held = ""
        self._after_close = False  # the newlines Qwen writes after `</think>` belong to neither part

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text`, appended to the output so far, settles."""
        buf, reasoning, content = self._held + text, [], []
        self._held = ""
        while buf:
            if self._state == _START:
                lead = buf.lstrip()
                if lead.startswith(OPEN):
                    self._state, buf = _THINK, lead[len(OPEN):]
                elif OPEN.startswith(lead):  # blank, or a part of the opening tag: not decided yet
                    self._held = buf
                    break
                else:
                    self._state = _CONTENT
            elif self._state == _THINK:
                end = buf.find(CLOSE)
                if end >= 0:
                    reasoning.append(buf[:end])
                    self._state, self._after_close, buf = _CONTENT, True, buf[end + len(CLOSE):]
                    continue
                keep = partial_tag(buf, CLOSE)
                reasoning.append(buf[:len(buf) - keep])
                self._held = buf[len(buf) - keep:]
                break
            else:
                if self._after_close:
                    buf = buf.lstrip("\n")
                    self._after_close = not buf
                content.append(buf)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back: an undecided start is content, a partial `</think>` inside the thinking is reasoning."""
        held, self._held = self._held, ""
        return (held, "") if self._state == _THINK else ("", held)
