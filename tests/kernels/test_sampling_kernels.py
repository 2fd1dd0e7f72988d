"""The greedy argmax kernels vs torch.argmax (CPU under TRITON_INTERPRET=1, GPU when present)."""
from __future__ import annotations

import pytest
import torch
from triton_testing import DEVICE

from loopline.kernels.sampling import argmax_rows


@pytest.mark.parametrize("vocab", [5000, 2048, 49152])  # a ragged last chunk, one chunk, Ouro's vocabulary
def test_argmax_rows_is_torch_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1, 17] = x[1, vocab - 3] = x[1].max() + 1  # a tie: the first index wins
    x[2] = float("-inf")  # all -inf: index 0, as torch
    x[3, vocab // 2] = float("nan")  # a NaN counts as the largest value
    x[3, vocab - 1] = float("inf")
    x[4, 3] = x[4, vocab - 2] = float("nan")  # the first NaN
    x[5, :] = 0.0
    x[5, vocab - 1] = 1e-30  # the maximum in the last chunk
    x = x.to(DEVICE)
    want = x.cpu().argmax(dim=-1)
    assert argmax_rows(x).cpu().tolist() == want.tolist()
    assert want.tolist()[1:5] == [17, 0, vocab // 2, 3]  # the cases are what they claim
    # a view with a row stride (logits of a wider buffer)
    wide = torch.randn(3, vocab + 64, generator=g).to(DEVICE)[:, :vocab]
    assert torch.equal(argmax_rows(wide).cpu(), wide.cpu().argmax(dim=-1))


def test_argmax_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="fp32"):
        argmax_rows(torch.zeros(2, 8, dtype=torch.float16, device=DEVICE))
    assert argmax_rows(torch.zeros(0, 8, device=DEVICE)).shape == (0,)
