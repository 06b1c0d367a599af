"""Top-k error feedback keeps what was not accepted (issue 14, item 2).

Invariant checked everywhere: for every client, what it produced = what was applied + its
residual + what it still has in flight. Before the fix an upload that was refused, came late,
sat in an aborted or failed round, or was never sent lost its coordinates for good.
"""

import pytest
import torch

from shoal.aggregation.compression import Compressor, TopK, decode_tensors
from shoal.config import CompressionConfig


def dense(enc, numel):
    return decode_tensors({"encoding": enc.encoding, **enc.header}, enc.tensors, numel).double()


def test_accepted_uploads_commit_and_refused_ones_fold_back():
    numel, g = 200, torch.Generator().manual_seed(0)
    comp = Compressor(CompressionConfig(encoding="topk", topk_fraction=0.05))
    produced, applied = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    for r in range(12):
        d = torch.randn(numel, generator=g)
        produced += d.double()
        enc = comp.encode(d, "c", tag=r)
        if r % 3 == 0:  # refused / late / never sent: reported not accepted
            comp.not_accepted("c", tag=r)
        else:
            comp.accepted("c", tag=r)
            applied += dense(enc, numel)
        torch.testing.assert_close(applied + comp.topk.residuals["c"].double(), produced, atol=1e-5, rtol=1e-5)
    assert not comp.topk.in_flight


def test_a_refused_upload_leaves_the_residual_as_if_it_was_never_encoded():
    tk = TopK(0.1)
    d1, d2 = torch.arange(20.0), torch.ones(20)
    tk.compress(d1, "c", tag=1)
    tk.accepted("c", tag=1)
    before = tk.residuals["c"].clone()
    tk.compress(d2, "c", tag=2)
    tk.not_accepted("c", tag=2)
    torch.testing.assert_close(tk.residuals["c"], before + d2)  # everything of upload 2 is still to send


def test_overlapping_uploads_settled_out_of_order_lose_nothing_and_count_nothing_twice():
    """A second upload may be encoded before the first is settled; it never re-sends the first's values."""
    numel, g = 100, torch.Generator().manual_seed(3)
    tk = TopK(0.1)
    produced, applied = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    sent = {}
    for tag in range(6):
        d = torch.randn(numel, generator=g)
        produced += d.double()
        sent[tag] = tk.compress(d, "c", tag)
    for tag in (4, 1, 5, 0, 2, 3):  # outcomes arrive in another order
        if tag in (1, 2):
            tk.not_accepted("c", tag)
        else:
            tk.accepted("c", tag)
            idx, vals = sent[tag]
            applied.index_add_(0, idx.long(), vals.double())
    torch.testing.assert_close(applied + tk.residuals["c"].double(), produced, atol=1e-5, rtol=1e-5)


def test_a_caller_that_never_reports_gets_commit_on_encode_and_bounded_memory():
    """client/node.py does not report outcomes yet: the untagged record is replaced by the next one."""
    tk = TopK(0.1)
    g = torch.Generator().manual_seed(1)
    sent, total = torch.zeros(100), torch.zeros(100)
    for _ in range(5):
        d = torch.randn(100, generator=g)
        total += d
        idx, vals = tk.compress(d, "c1")
        sent[idx.long()] += vals
    torch.testing.assert_close(sent + tk.residuals["c1"], total)
    assert len(tk.in_flight) == 1
    tk.forget("c1")
    assert not tk.in_flight and "c1" not in tk.residuals


@pytest.mark.parametrize("encoding", ["dense", "q8"])
def test_outcomes_are_no_ops_without_error_feedback(encoding):
    comp = Compressor(CompressionConfig(encoding=encoding))
    comp.encode(torch.ones(10), "c", tag=0)
    comp.accepted("c", tag=0)
    comp.not_accepted("c", tag=0)
