"""Finding tags in text that arrives in pieces: how much of a piece's end may be the start of a tag, so that it is
held back until the next piece says whether the tag is there."""

from __future__ import annotations


def partial_tag(text: str, *tags: str) -> int:
    """The length of the longest end of `text` that is a proper start of one of `tags` (0: nothing to hold)."""
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
