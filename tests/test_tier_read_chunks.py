"""Whole-block reads a chunk at a time: every row's record, whatever the runs and chunk edges."""

from __future__ import annotations

import tempfile
from unittest import mock

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recscale.embedding import tier_file
from recscale.embedding.tier_file import RowFile, TierFileMeta

# 1,004-byte records, 4 a block: a few dozen rows span many blocks, runs of adjacent ones and
# chunk edges.
META = TierFileMeta("t", 600, 0, 250, "fp32", (("m", 1),), 0)


def _init(start: int, n: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.arange(start, start + n, dtype=torch.float32)[:, None]
    return ids.expand(n, META.dim).contiguous(), {"m": -ids}


@settings(max_examples=25, deadline=None)
@given(picks=st.sets(st.integers(0, META.num_rows - 1), min_size=1, max_size=120), chunk=st.integers(1, 3))
def test_read_blocks_returns_each_rows_record(picks: set[int], chunk: int) -> None:
    with tempfile.TemporaryDirectory() as d, mock.patch.object(tier_file, "CHUNK_BLOCKS", chunk):
        f = RowFile.create(d, META, _init)
        try:
            rows = np.array(sorted(picks), dtype=np.int64)
            plan = f.plan(rows)
            out = np.empty((rows.size, META.record_bytes), dtype=np.uint8)
            f.read_blocks(plan, out)
            f.plan_done(plan)
            w, state = tier_file.decode(META, torch.from_numpy(out), torch.float32)
            want = torch.from_numpy(rows).to(torch.float32)[:, None]
            assert torch.equal(w, want.expand(-1, META.dim))
            assert torch.equal(state["m"], -want)
            assert f.pool_bytes <= f.pool_blocks * f.block_bytes
        finally:
            f.close()
