import copy

import pytest
import torch

from tandem.config import ConfigError, ModelConfig
from tandem.model.presets import PRESETS, preset_config


def test_nested_vl_config_and_top_level_tie():
    text = dict(PRESETS["tiny-moe"], model_type="qwen3_5_moe_text")
    del text["tie_word_embeddings"]
    raw = {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": True, "vision_config": {}}
    cfg = ModelConfig.from_hf(raw)
    assert cfg.tie_word_embeddings and cfg.num_experts == 8 and cfg.ssm_dtype == torch.float32
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.rotary_dim == 8  # 32 * 0.25


def test_layer_types_list_wins_and_is_checked():
    raw = dict(PRESETS["tiny-dense"], layer_types=["full_attention", "linear_attention"] * 2)
    assert ModelConfig.from_hf(raw).attention_layers == [0, 2]
    raw["layer_types"] = ["full_attention"] * 3
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf(raw)


@pytest.mark.parametrize("field,value", [
    ("model_type", "llama"), ("num_key_value_heads", 3), ("hidden_size", None), ("linear_num_value_heads", 3),
    ("num_experts_per_tok", 99), ("hidden_act", "gelu"),
])
def test_bad_fields_are_named(field, value):
    raw = copy.deepcopy(PRESETS["tiny-moe"])
    raw[field] = value
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(raw)


def test_real_shapes():
    c = preset_config("qwen3.5-35b-a3b")
    assert (c.num_layers, len(c.gdn_layers), len(c.attention_layers)) == (40, 30, 10)
    assert c.rotary_dim == 64 and c.num_experts == 256 and c.gdn_num_v_heads == 32
