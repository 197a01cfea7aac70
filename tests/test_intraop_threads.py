"""gpupipe's own torch work on the training thread (the stage's tails and MixUp/CutMix on the CPU)
runs on that thread alone: torch's intra-op team, spinning after each parallel region, would take the cores from the
loader's threads. Only the calling thread's count changes, and only for the block."""

from __future__ import annotations

import threading

import pytest
import torch

from gpupipe.runtime import _threads
from gpupipe.runtime._threads import one_intraop_thread

pytestmark = pytest.mark.skipif(_threads.openmp() is None, reason="torch's intra-op threads are not OpenMP's here")


def count_in_a_new_thread() -> int:
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


@pytest.mark.usefixtures("two_threads")
class TestOneIntraopThread:
    def test_the_block_runs_on_one_thread_and_the_count_comes_back(self):
        with one_intraop_thread():
            assert torch.get_num_threads() == 1
            x = torch.rand(4, 3, 176, 176)  # a parallel-sized operation still runs, serially
            assert torch.equal(x.mul(0.5).add_(x), x * 0.5 + x)
        assert torch.get_num_threads() == 2

    def test_the_count_comes_back_after_an_error(self):
        with pytest.raises(RuntimeError, match="boom"), one_intraop_thread():
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2

    def test_other_threads_keep_their_count(self):
        """Not ``torch.set_num_threads``: a thread started during the block gets the process's
        default, and one already running keeps its own."""
        inside = threading.Event()
        leave = threading.Event()
        seen = []

        def other():
            torch.get_num_threads()  # its own count, set up before the block
            inside.wait(10)
            seen.append(torch.get_num_threads())
            leave.set()

        t = threading.Thread(target=other)
        t.start()
        with one_intraop_thread():
            inside.set()
            assert leave.wait(10)
            assert count_in_a_new_thread() == 2
        t.join()
        assert seen == [2]

    def test_nested_blocks_restore_the_outer_count(self):
        with one_intraop_thread():
            with one_intraop_thread():
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2


def test_without_openmp_it_changes_nothing(monkeypatch, two_threads):
    monkeypatch.setattr(_threads, "openmp", lambda: None)
    with one_intraop_thread():
        assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_the_stage_on_the_cpu_runs_on_one_thread(monkeypatch):
    """The stage's tails (DALI-CPU's, run by the loader on the training thread), as the mix."""
    import numpy as np

    from gpupipe import transforms as T
    from gpupipe.backends._stage import _delivered

    seen: list[int] = []
    run_stage = _delivered.run_stage

    def counted(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return run_stage(*args, **kwargs)

    monkeypatch.setattr(_delivered, "run_stage", counted)
    steps = (T.TrivialAugmentWide(), T.ToDtype(torch.float32, scale=True))
    stage = _delivered.Stage((steps,), (0,))
    images = torch.zeros(4, 3, 16, 16, dtype=torch.uint8)
    (out,), _ = stage.finish((images,), None, np.ones(4, dtype=bool), seed=0, epoch=0, rank=0, batch=0,
                             draws=np.arange(4))  # fmt: skip
    assert seen == [1] and out.dtype == torch.float32
    assert torch.get_num_threads() == 2
