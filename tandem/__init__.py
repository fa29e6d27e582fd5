"""Tandem: disaggregated serving for Qwen3.5-class hybrid models."""

from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]
