"""Host-to-device helpers of tandem/batch.py against plain indexing: `to_device` (one copy for several host
arrays, torch or numpy) and `take_rows` (rows by a host list, without a pageable index copy)."""

import numpy as np
import torch

from tandem.batch import take_rows, to_device


def test_to_device_keeps_values_shapes_and_aligns_each_part():
    parts = [np.arange(7, dtype=np.int64), torch.arange(12).reshape(3, 4) * -1, np.zeros((0,), np.int64),
             np.array([[5, 6]], np.int64), torch.tensor([9])]
    out = to_device("cpu", *parts)
    for p, o in zip(parts, out):
        assert o.dtype == torch.long and tuple(o.shape) == tuple(p.shape)
        assert torch.equal(o, torch.as_tensor(p))
        assert o.data_ptr() % 16 == 0  # each part starts where a fresh tensor would (Triton specialises on it)


def test_take_rows_is_indexing_by_the_list():
    x = torch.randn(10, 3)
    for rows in ([4, 0, 9], [2, 2, 2], [], list(range(10))[::-1]):
        assert torch.equal(take_rows(x, rows), x[rows]), rows
