"""vLLM-shaped sampling parameters, validated on construction (a bad value raises ValueError and changes nothing)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.structured import StructuredOutputs


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top-n logprobs per generated token
    # top-n logprobs per prompt token after the first, plus the prompt token's own (vLLM's prompt_logprobs)
    prompt_logprobs: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    structured_outputs: StructuredOutputs | None = None  # a grammar the output follows (tandem/structured.py)

    def __post_init__(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)

        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
              f"max_tokens must be >= 1, got {self.max_tokens}")
        check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        check(isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
              f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
              f"logprobs must be a non-negative integer, got {self.logprobs}")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
              f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs}")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
              f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids must be non-negative ints")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
