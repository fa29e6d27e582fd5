"""Where a model comes from: a checkpoint directory (config.json and safetensors) or a built-in preset of random
weights (`presets.py`)."""

from __future__ import annotations

import os

import torch

from tandem.config import ModelConfig
from tandem.model.loader import load_checkpoint
from tandem.model.presets import preset_config, random_model
from tandem.parallel import SINGLE, TPGroup, check_divisible


def model_config(model: str) -> ModelConfig:
    """The config of a checkpoint directory or a preset name (a clear error naming both for anything else)."""
    return ModelConfig.from_dir(model) if os.path.isdir(model) else preset_config(model)


def load_model(model: str, device: str, dtype: torch.dtype, seed: int = 0, tp: TPGroup = SINGLE):
    """A directory with a checkpoint, or a preset name (random weights); under tensor parallelism this rank's
    shard. Returns (cfg, model, model_dir or None)."""
    cfg = model_config(model)
    check_divisible(cfg, tp.world_size)
    if os.path.isdir(model):
        return cfg, load_checkpoint(model, cfg, device, dtype, tp=tp), model
    return cfg, random_model(cfg, device, dtype, seed, tp), None
