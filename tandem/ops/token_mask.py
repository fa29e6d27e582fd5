"""Grammar masks on logit rows (structured outputs): every token whose bit is clear in a row's bitmask gets -inf.

`mask_rows_(logits, rows, bitmask)`: logits [R, V] fp32, rows [n] int64 (the rows to mask), bitmask [n, ceil(V/32)]
int32 (bit b of word w = token 32w + b), in place. The torch reference expands the bits ([n, words, 32]) and
writes the masked rows back; the kernel reads each row's words and writes -inf over the refused tokens only.
"""

import torch

from tandem.ops.triton_utils import HAS_TRITON, pdl, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tandem.ops.triton_utils import wait_for_prior_kernels

    @triton.jit
    def _mask_rows_kernel(logits_ptr, rows_ptr, bits_ptr, vocab, stride, words, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        wait_for_prior_kernels(PDL)
        r, b = tl.program_id(0), tl.program_id(1)
        row = tl.load(rows_ptr + r)
        cols = b * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        w = tl.load(bits_ptr + r * words + cols // 32, mask=inside, other=0)
        refused = ((w >> (cols % 32)) & 1) == 0
        tl.store(logits_ptr + row * stride + cols, tl.full([BLOCK], float("-inf"), tl.float32),
                 mask=inside & refused)


def mask_rows_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    if use_triton(logits):
        mask_rows_triton_(logits, rows, bitmask)
    else:
        mask_rows_torch_(logits, rows, bitmask)


def masked(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with the tokens whose bit is clear in bitmask [n, ceil(V / 32)] set to -inf (a copy)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=bitmask.device)) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def mask_rows_torch_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    logits.index_copy_(0, rows, masked(logits.index_select(0, rows), bitmask))


def mask_rows_triton_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor, block: int = 1024) -> None:
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and bitmask.is_contiguous()
    n, vocab = rows.numel(), logits.shape[1]
    if n:
        _mask_rows_kernel[(n, triton.cdiv(vocab, block))](logits, rows, bitmask, vocab, logits.stride(0),
                                                          bitmask.shape[1], BLOCK=block, **pdl(logits))
