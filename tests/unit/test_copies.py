"""copies.copy_pages on the host: every byte in place, whatever the runs of slots, and the
copy threads given even shares of the bytes. No Ray."""

import numpy as np
import pytest
import torch

from cluster.core import copies
from cluster.core.kvcheck import page_rows, slab_order

LAYERS, HEADS, DIM, PAGE_TOKENS, PAGES = 32, 2, 64, 16, 16


def _pairs(runs: list[int]):
    kv = torch.randn(LAYERS, 2, HEADS, PAGE_TOKENS * PAGES, DIM)
    slab = torch.zeros(PAGES, LAYERS, 2, HEADS, PAGE_TOKENS, DIM)
    rows, pairs, first = page_rows(kv, PAGE_TOKENS), [], 0
    for count in runs:
        pairs.append((slab_order(slab[first:first + count]), rows[:, :, :, first:first + count]))
        first += count
    return kv, slab, pairs


@pytest.mark.parametrize("runs", [[16], [8, 1, 4, 2, 1], [13, 1, 1, 1], [1] * 16, [3, 5, 8]])
def test_every_run_of_slots_is_copied_whole(monkeypatch, runs):
    monkeypatch.setattr(copies, "PARALLEL_MIN_BYTES", 0)  # the threaded path at this size
    kv, slab, pairs = _pairs(runs)
    copies.copy_pages(pairs)
    assert torch.equal(slab_order(slab), page_rows(kv, PAGE_TOKENS))


@pytest.mark.parametrize("runs", [[16], [8, 1, 4, 2, 1], [13, 1, 1, 1], [3, 5, 8], [1] * 64])
def test_the_threads_get_even_shares_of_uneven_runs(runs):
    """Dealt in turn, runs of 8, 1, 4, 2 and 1 pages gave one thread 13 of 16 pages (a put
    into a full tier's scattered free slots ran at 0.75x a memcpy of one run)."""
    blocks = [(np.empty(count * 4096, np.uint8).reshape(count * 4, 1024),) * 2 for count in runs]
    for num_threads in (2, 4):
        shares = copies._balanced_shares(blocks, num_threads)
        loads = [sum(src.nbytes for _, src in share) for share in shares]
        total = sum(src.nbytes for _, src in blocks)
        assert sum(loads) == total
        assert max(loads) <= total / num_threads + max(4096, total / (4 * num_threads))
