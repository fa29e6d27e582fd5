"""The multi-token-prediction head (`mtp.*` weights), sharing the target's embedding and lm_head.

At position t it combines the target's final post-norm hidden h_t with the embedding of the next token x_{t+1}:
    u = fc([norm_e(embed(x_{t+1})), norm_h(h_t)]);  u = layer(u);  out = norm(u);  logits = lm_head(out)
`layer` is one gated full-attention decoder layer (MoE when the model is MoE) with its own paged KV cache, indexed
by position t (split across tensor-parallel ranks like the target's layers; fc and the norms are replicated).
Drafting k > 1 tokens runs the same head again at position t+1 on its own output `out` and its own
draft token.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.config import ModelConfig
from tandem.batch import ForwardBatch
from tandem.model.qwen3_5 import DecoderLayer, RMSNorm1p
from tandem.parallel import SINGLE, TPGroup


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = SINGLE):
        super().__init__()
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm1p(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm1p(H, cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, is_attention=True, is_moe=any(cfg.moe_layers), tp=tp)])
        self.norm = RMSNorm1p(H, cfg.rms_norm_eps)

    def forward(self, next_token_embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, inv_freq,
                kv_cache) -> torch.Tensor:
        """next_token_embeds, hidden: [T, H] -> post-norm MTP hidden [T, H] (feed to lm_head, or to the next
        recursion step as `hidden`). `batch.positions` are the positions t of `hidden`."""
        u = self.fc(torch.cat([self.pre_fc_norm_embedding(next_token_embeds), self.pre_fc_norm_hidden(hidden)], -1))
        return self.norm.residual(*self.layers[0](u, None, batch, inv_freq, kv_cache))[1]
