"""Two-phase copies on CPU: issued copies are invisible until poll()/wait(), complete in issue order and run
their completion callback exactly once; the reader fence counts finished epochs."""

from __future__ import annotations

import torch

from dhisparse.kv.copies import CopyEngine, ReaderFence

CPU = torch.device("cpu")


def test_issued_copy_is_done_only_at_poll() -> None:
    engine = CopyEngine(CPU)
    src, dst = torch.arange(12.0).view(6, 2), torch.zeros(4, 2)
    done = []
    ticket = engine.issue("fetch", dst, torch.tensor([3, 0]), src, torch.tensor([1, 5]), lambda: done.append(1))
    assert not ticket.done and not bool(dst.any()) and engine.num_pending == 1
    src[1] = -1.0  # sources must stay unchanged until done: the copy reads them at completion
    assert engine.poll() == 1
    assert ticket.done and done == [1]
    assert dst.tolist() == [[10.0, 11.0], [0.0, 0.0], [0.0, 0.0], [-1.0, -1.0]]
    assert engine.poll() == 0 and done == [1] and engine.rows_copied == {"fetch": 2}


def test_wait_completes_every_earlier_copy_in_issue_order() -> None:
    engine = CopyEngine(CPU)
    buf = torch.zeros(3, 1)
    order = []
    first = engine.issue("a", buf, torch.tensor([0]), torch.ones(1, 1), torch.tensor([0]), lambda: order.append("a"))
    second = engine.issue("b", buf, torch.tensor([0]), torch.full((1, 1), 2.0), torch.tensor([0]),
                          lambda: order.append("b"))
    third = engine.issue("c", buf, torch.tensor([1]), torch.ones(1, 1), torch.tensor([0]), lambda: order.append("c"))
    engine.wait(second)
    assert first.done and second.done and not third.done
    assert order == ["a", "b"] and buf[0, 0] == 2.0 and buf[1, 0] == 0.0  # later write wins, in order
    engine.wait(second)  # waiting on a done ticket is a no-op
    engine.wait_all()
    assert order == ["a", "b", "c"] and engine.num_pending == 0


def test_reader_fence_epochs() -> None:
    fence = ReaderFence(CPU)
    assert fence.finished(0) and not fence.in_flight
    epoch = fence.begin()
    assert epoch == 1 and fence.in_flight and not fence.finished(1)
    fence.end()
    assert fence.finished(1) and not fence.in_flight
