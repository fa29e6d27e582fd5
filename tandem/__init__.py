"""Tandem: disaggregated serving for Qwen3.5-class hybrid models."""

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
