"""The first hint of a reader that starts inside a run (docs/performance.md, "Where a cold
epoch's time went")."""

from __future__ import annotations

from tests.cache.test_plan import small_plan


def test_a_reader_starting_inside_a_run_hints_that_chunk_first(tmp_path):
    # Positions [0, 2) were handed out before this reader started (the main process's
    # first batch, or a resume): it reads the rest of chunk 0 first. Left out of the
    # hint, chunk 0 was fetched only when asked for, behind the prefetches of chunks
    # 1-3, and landed last (traced: a worker waited 2.4 s for it in a 512 MiB epoch).
    rp = small_plan(tmp_path, batch_size=4, skipped=2)
    assert rp.upcoming(3) == [0, 1, 2]
    assert not rp.start(0)  # read within its run: no new hint, the prefetch goes on
    assert rp.upcoming(3) == [0, 1, 2]
    assert rp.start(1)
    assert rp.upcoming(2) == [1, 2]
    rp.close()


def test_a_reader_starting_at_a_run_boundary_hints_as_before(tmp_path):
    rp = small_plan(tmp_path, batch_size=4, skipped=4)
    assert rp.upcoming(3) == [1, 2, 3]
    rp.close()
