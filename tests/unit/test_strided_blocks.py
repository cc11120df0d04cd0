"""`strided_blocks` (pure): how a non-contiguous tensor is cut into bounded blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from aiopersist._stream import strided_blocks


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(1 << 16)[::3],  # 1-D strided
        lambda: torch.randn(64, 5000).t(),  # rows smaller than the limit
        lambda: torch.randn(3, 9000, 2)[:, ::2, :],  # a row larger than the limit
        lambda: torch.randn(4, 3, 5000).permute(2, 0, 1)[::2],
        lambda: torch.arange(10)[::2][1:2],
        lambda: torch.tensor(2.5),
        lambda: torch.empty(0, 7).t(),
    ],
)
def test_strided_blocks_cover_the_tensor_in_order_within_the_limit(make: Any) -> None:
    t = make()
    limit = 4096
    blocks = list(strided_blocks(t, limit))
    for b in blocks:
        assert b.numel() * b.element_size() <= max(limit, t.element_size())
    joined = torch.cat([b.reshape(-1) for b in blocks]) if blocks else torch.empty(0)
    assert torch.equal(joined, t.reshape(-1))
