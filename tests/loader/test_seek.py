"""Seek and skip through CacheDataLoader.

* ``state_for_step(S)`` is the state an uninterrupted run saves after ``S`` batches, and a
  loader that seeks to ``S`` delivers exactly the uninterrupted run's batches from ``S`` on;
  seeking reads nothing (no chunk fetched from a real S3 server before the first batch,
  and only the chunks of the batches after ``S`` after it).
* ``skip(a, b)``: the run delivers the uninterrupted batches without steps ``[a, b)``
  (dropped for their epoch); stopped anywhere around the skip and resumed in a fresh
  loader that was never told of it, it continues exactly (hypothesis over stop points).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asynccache import CacheDataLoader, ConfigError, ResumeStateError, StreamingDataset
from asynccache.torch.fetcher import Fetcher
from tests.loader.datasets import DictDataset
from tests.remote_data import upload_dataset, write_dataset

EPOCHS = 3
CHUNK = 5
pytestmark = pytest.mark.timeout(600)
PROFILE = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[int, Path] = {}

    def get(n: int) -> Path:
        if n not in made:
            path = tmp_path_factory.mktemp(f"w{n}")
            list(CacheDataLoader(DictDataset(n), cache_dir=path, chunk_size=CHUNK))
            made[n] = path
        return made[n]

    return get


def loader(path: Path, cfg: dict[str, Any], **kw: Any) -> CacheDataLoader:
    ds = StreamingDataset(
        path, shuffle=cfg.get("shuffle", True), seed=5, drop_last=cfg.get("split_drop", False)
    )
    return CacheDataLoader(
        ds,
        batch_size=cfg["bs"],
        drop_last=cfg.get("drop_last", False),
        num_workers=kw.pop("num_workers", cfg.get("workers", 0)),
        **kw,
    )


def keys(batch: Any) -> list[int]:
    return batch["i"].tolist()


def epochs_of(dl: CacheDataLoader, first: int = 0) -> list[list[list[int]]]:
    """Each epoch's batches from ``first`` (the loader's next epoch) to the last."""
    return [[keys(b) for b in dl] for _ in range(first, EPOCHS)]


configs = st.fixed_dictionaries(
    {
        "n": st.integers(4, 31),
        "bs": st.integers(1, 5),
        "drop_last": st.booleans(),
        "split_drop": st.booleans(),
        "shuffle": st.booleans(),
    }
)


@PROFILE
@given(cfg=configs, data=st.data())
@example(cfg={"n": 23, "bs": 4, "drop_last": True, "split_drop": False, "shuffle": True},
         data=None)  # fmt: skip
def test_state_for_step_is_the_uninterrupted_state_and_seek_continues_there(written, cfg, data):
    path = written(cfg["n"])
    whole, states = [], []
    dl = loader(path, cfg)
    for _ in range(EPOCHS):
        it = iter(dl)
        for b in it:
            whole.append(keys(b))
            states.append(dl.state_dict())
    per = dl.steps_per_epoch
    assert len(whole) == EPOCHS * per, "steps_per_epoch: the batches of each epoch"
    if not per:  # (drop_last and fewer samples than a batch)
        with pytest.raises(ConfigError, match="no steps"):
            dl.seek(0)
        return
    steps = [0, per - 1, per, EPOCHS * per - 1]
    if data is not None:
        steps.append(data.draw(st.integers(0, EPOCHS * per - 1)))
    for step in steps:
        fresh = loader(path, cfg)
        state = fresh.state_for_step(step)
        if step and step % per:  # (at an epoch's end the run's state says "all received")
            assert state == states[step - 1], "the state an uninterrupted run saves"
        fresh.seek(step)
        assert fresh.state_dict() == state
        assert fresh.epoch == step // per
        rest = [b for e in epochs_of(fresh, step // per) for b in e]
        assert rest == whole[step:], "continues at step S's batch"


def test_seek_far_away_and_with_workers(written):
    path = written(29)
    cfg = {"bs": 3}
    dl = loader(path, cfg)
    per = dl.steps_per_epoch
    # (the batches' order depends on the worker count: each worker reads its own run)
    ref = epochs_of(loader(path, cfg, num_workers=2), 0)
    step = 10**6 * per + 4  # epoch 10**6: a state of a few integers, no replay
    state = dl.state_for_step(step)
    assert state["epoch"] == 10**6 and state["stream"]["received"] == 12
    for persistent in (False, True):
        w = loader(path, cfg, num_workers=2, persistent_workers=persistent)
        w.seek(per + 2)
        assert [keys(b) for b in w] == ref[1][2:]
        assert [keys(b) for b in w] == ref[2]
    with pytest.raises(ConfigError, match="step"):
        dl.seek(-1)
    with pytest.raises(ConfigError, match="step"):
        dl.state_for_step(1.5)  # type: ignore[arg-type]


def test_seek_fetches_nothing_before_its_batch(objstore, bucket, tmp_path):
    """Seeking to a late step of a remote dataset reads nothing; the rest of the epoch
    fetches only its own chunks, not those of the batches skipped over."""
    src = write_dataset(tmp_path / "src", 60, chunk_size=CHUNK)
    url = upload_dataset(src, f"s3://{bucket}/ds", objstore.storage_options)

    def remote() -> StreamingDataset:
        return StreamingDataset(
            url, cache_dir=tmp_path / "cache", storage_options=objstore.storage_options
        )

    dl = CacheDataLoader(remote(), batch_size=4)
    per = dl.steps_per_epoch
    dl.seek(7 * per + 12)  # the epoch's last 12 items
    dl.state_dict()
    assert dl.dataset.download_stats()["chunks_fetched"] == 0, "a seek reads nothing"
    got = [k for b in dl for k in keys(b)]
    assert got == list(range(48, 60))
    assert dl.dataset.download_stats()["chunks_fetched"] <= 12 // CHUNK + 2, (
        "only the chunks of the batches after the step"
    )


@st.composite
def skip_cases(draw):
    cfg = draw(configs)
    return cfg, draw(st.integers(0, 12)), draw(st.integers(1, 12)), draw(st.integers(-3, 3))


@PROFILE
@given(case=skip_cases())
@example(case=({"n": 20, "bs": 2, "drop_last": False, "split_drop": False, "shuffle": True},
               3, 4, 0))  # fmt: skip
@example(case=({"n": 9, "bs": 2, "drop_last": True, "split_drop": False, "shuffle": False},
               2, 9, 1))  # fmt: skip
def test_skip_drops_its_steps_and_a_resume_skips_them_again(written, case):
    cfg, start, length, around = case
    path = written(cfg["n"])
    plain = epochs_of(loader(path, cfg))
    per = len(plain[0])
    end = start + length
    # Definition: the uninterrupted batches without steps [start, end).
    want = [
        [b for t, b in enumerate(batches) if not start <= e * per + t < end]
        for e, batches in enumerate(plain)
    ]
    dl = loader(path, cfg)
    dl.skip(start, end)
    got, lens = [], []
    for _ in range(EPOCHS):
        lens.append(len(dl))
        got.append([keys(b) for b in dl])
    assert got == want, "the skipped steps' batches are never delivered"
    assert lens == [len(x) for x in want], "len() counts the batches an epoch delivers"
    # Stop around the skip (in delivered batches), save, resume in a fresh loader.
    flat = [b for e in want for b in e]
    before = sum(1 for e, bs in enumerate(plain) for t in range(len(bs)) if e * per + t < start)
    stop = min(max(0, before + around), len(flat))
    dl = loader(path, cfg)
    dl.skip(start, end)
    head: list[list[int]] = []
    state = dl.state_dict()
    for _ in range(EPOCHS):
        if len(head) == stop:
            break
        it = iter(dl)
        for b in it:
            head.append(keys(b))
            if len(head) == stop:
                break
        state = dl.state_dict()
    again = loader(path, cfg)
    again.load_state_dict(state)
    assert again.skips == [(start, end)], "the state carries the skipped range"
    tail = [b for e in epochs_of(again, again.epoch) for b in e]
    assert head + tail == flat, "exact: nothing repeated, nothing skipped twice"


def test_skip_while_running_seek_into_a_skip_and_refusals(written):
    path = written(30)
    cfg = {"bs": 2}
    plain = [b for e in epochs_of(loader(path, cfg, num_workers=2)) for b in e]
    per = len(plain) // EPOCHS
    dl = loader(path, cfg, num_workers=2)
    it = iter(dl)
    got = [keys(next(it)) for _ in range(3)]
    dl.skip(4, 9)  # mid-epoch: from the next batch on
    dl.skip(0, 2)  # already passed: nothing
    got += [keys(b) for b in it]
    assert got == plain[:4] + plain[9:per]
    dl.seek(5)  # inside the skip: lands after it
    state = dl.state_dict()
    assert state["stream"] == loader(path, cfg, num_workers=2).state_for_step(9)["stream"]
    assert state["batches"] == 2 and state["skips"] == [[0, 2], [4, 9]], "9 less 7 skipped"
    assert [keys(b) for b in dl] == plain[9:per]
    state = dl.state_dict()
    with pytest.raises(ResumeStateError, match="skips steps"):
        loader(path, {"bs": 3}).load_state_dict(state)
    with pytest.raises(ConfigError, match="start < end"):
        dl.skip(3, 3)
    with pytest.raises(ConfigError, match="integer"):
        dl.skip(1.0, 3)  # type: ignore[arg-type]
    broken = dict(state, skips=[[5, 2]])
    with pytest.raises(ResumeStateError, match="skips"):
        loader(path, cfg).load_state_dict(broken)
    plain = [b for e in epochs_of(loader(path, cfg)) for b in e]  # (one process)
    # A skip reaching into the next epoch: this one ends early, the next starts after it.
    dl = loader(path, cfg)
    dl.skip(per - 2, per + 3)
    first, second = [keys(b) for b in dl], [keys(b) for b in dl]
    assert first == plain[: per - 2] and second == plain[per + 3 : 2 * per]
    # Through the Fetcher, whose thread takes the loader's state after each batch.
    dl = loader(path, cfg)
    dl.skip(2, 5)
    fetcher = Fetcher(dl, prefetch_batches=2)
    out = []
    for b in fetcher:
        out.append(keys(b))
        if len(out) == 4:
            state = fetcher.state_dict()
    assert out == plain[:2] + plain[5:per]
    again = loader(path, cfg)
    again.load_state_dict(state)
    assert [keys(b) for b in again] == plain[7:per]


def test_a_loader_that_writes_its_cache_has_no_steps_yet(tmp_path):
    dl = CacheDataLoader(DictDataset(10), cache_dir=tmp_path / "c", chunk_size=CHUNK)
    with pytest.raises(ConfigError, match="writes the cache"):
        dl.seek(3)
    list(dl)
    assert os.path.exists(tmp_path / "c" / "index.json")
    dl.seek(3)  # the cache is written: the streamed epochs have steps
    assert [keys(b) for b in dl] == [[k] for k in range(3, 10)]
