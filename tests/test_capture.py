"""``ssm_spec.capture``: what a capture must survive (CUDA), and the collection pause it takes."""

import gc
import threading
import weakref

import pytest
import torch

from ssm_spec.capture import GraphCapture, collection_paused

@pytest.mark.parametrize("enabled", [True, False])
def test_collection_paused_nests_survives_errors_and_restores_the_state_it_found(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(KeyError):
            with collection_paused():
                assert not gc.isenabled()
                with collection_paused():
                    assert not gc.isenabled()
                assert not gc.isenabled()  # the outer block still holds it
                raise KeyError
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_collection_stays_paused_until_the_last_thread_leaves():
    """Two threads' blocks overlap: the one that began first, and leaves first, does not turn
    collection back on under the other (``gc`` is per process)."""
    inside, leave_first, seen = threading.Event(), threading.Event(), []

    def first():
        with collection_paused():
            inside.set()
            leave_first.wait(5)

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(5)
    with collection_paused():
        leave_first.set()
        t.join(5)
        seen.append(gc.isenabled())
    assert seen == [False] and gc.isenabled()


class _Cycle:
    """A captured graph in a reference cycle: freed only by a garbage collection."""

    def __init__(self, graph):
        self.graph = graph
        self.me = self


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
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
    survivors, alive_at_the_end_of_the_capture = [], []

    def body():
        holder.clear()  # the cycle is garbage from here on, inside the capture
        survivors.extend({} for _ in range(50_000))  # enough new containers for automatic gen-0 and gen-1 collections
        alive_at_the_end_of_the_capture.append(freed() is not None)
        return x.mul_(2)

    graph, out = capturer.capture(body)  # raises if the capture was invalidated
    # no collection ran inside the capture (one may run as soon as it ends: the pause is over)
    assert alive_at_the_end_of_the_capture == [True]
    x.fill_(3)
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(out, torch.full((4,), 6.0, device=device))
    gc.collect()
    assert freed() is None
