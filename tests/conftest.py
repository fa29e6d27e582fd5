import os
import sys

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter so the CPU suite checks them too (set before any
# kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))

from hf_models import KINDS, make_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """kind -> (hf model, directory written by save_pretrained)."""
    out = {}
    for kind in KINDS:
        model = make_hf_model(kind)
        d = tmp_path_factory.mktemp(f"hf-{kind}")
        model.save_pretrained(d)
        out[kind] = (model, str(d))
    return out
