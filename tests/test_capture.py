"""``ssm_spec.capture.GraphCapture``: what a capture must survive (CUDA only)."""

import gc
import weakref

import pytest
import torch

from ssm_spec.capture import GraphCapture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


class _Cycle:
    """A captured graph in a reference cycle: freed only by a garbage collection."""

    def __init__(self, graph):
        self.graph = graph
        self.me = self


def test_a_collection_inside_a_capture_does_not_free_a_graph_there():
    """A graph that becomes cyclic garbage while another is captured is not destroyed inside
    the capture (destroying a graph is an operation capture forbids: it invalidated the capture
    whenever Python's automatic collection ran in the captured code); the new graph replays,
    and the garbage is freed by the next collection after it."""
    device = torch.device("cuda")
    capturer = GraphCapture(device, "test")
    x = torch.zeros(4, device=device)
    capturer.warmup(lambda: x.add_(1))
    old, _ = capturer.capture(lambda: x.add_(1))
    holder = [_Cycle(old)]
    freed = weakref.ref(holder[0])
    del old
    survivors = []

    def body():
        holder.clear()  # the cycle is garbage from here on, inside the capture
        survivors.extend({} for _ in range(50_000))  # enough new containers for a full automatic collection
        return x.mul_(2)

    graph, out = capturer.capture(body)
    x.zero_()
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out, torch.zeros(4, device=device))
    x.fill_(1)
    graph.replay()
    assert torch.equal(x, torch.full((4,), 2.0, device=device))
    gc.collect()
    assert freed() is None
