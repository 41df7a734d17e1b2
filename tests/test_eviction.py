"""Eviction order of the tier's policies on hand-built slot histories."""

from __future__ import annotations

import torch

from recscale.embedding.eviction import EvictionPolicy


def _policy(name: str, last_use: list[int], freq: list[int]) -> EvictionPolicy:
    p = EvictionPolicy(name, len(last_use))
    p.last_use = torch.tensor(last_use)
    p.freq = torch.tensor(freq)
    return p


def test_lookahead_evicts_rows_outside_the_window_rarest_first_then_farthest():
    # slots:        0  1  2  3  4
    last_use = [5, 1, 4, 2, 3]
    next_use = torch.tensor([-1, -1, -1, 0, 2])  # slots 3 and 4 are needed in the window
    uses = torch.tensor([1, 3, 3, 1, 1])  # run-long use counts of each slot's row
    p = _policy("lookahead", last_use, [0] * 5)
    got = torch.argsort(p.rank(next_use, uses), descending=True).tolist()
    # Slot 0 (rarest, though most recent), then slots 1 and 2 (older first), then the window's
    # rows by next use: 4 before 3.
    assert got == [0, 1, 2, 4, 3]
    # Without counts, recency decides outside the window.
    assert torch.argsort(p.rank(next_use), descending=True).tolist() == [1, 2, 0, 4, 3]


def test_victims_skip_pinned_slots_and_come_out_ascending():
    p = _policy("lookahead", [1, 2, 3, 4], [0] * 4)
    uses = torch.tensor([1, 1, 1, 1])
    evictable = torch.tensor([False, True, True, True])
    victims = p.victims(2, evictable, torch.full((4,), -1), uses)
    assert victims.tolist() == [1, 2]  # slot 0 is the oldest but pinned


def test_lru_and_lfu_ignore_the_window():
    p = _policy("lru", [3, 1, 2], [5, 1, 9])
    assert torch.argsort(p.rank(None), descending=True).tolist() == [1, 2, 0]
    p = _policy("lfu", [3, 1, 2], [5, 1, 9])
    assert torch.argsort(p.rank(None), descending=True).tolist() == [1, 0, 2]
