"""The loader state's fields and checks as pure functions (asynccache.torch.loader_state);
tests/loader/test_resume.py and test_seek.py run them through real loaders."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asynccache import ResumeStateError
from asynccache.sampling.steps import Skips
from asynccache.torch.loader_state import (
    STATE_VERSION,
    base_state,
    check_map_settings,
    loaded_skips,
    map_resume,
    stream_received,
)


def _state(**kw: object) -> dict[str, object]:
    state = base_state(0, 3, True, world=2, num_workers=1, batch_size=4, skips=Skips().add(5, 7))
    state.update(items=40, seed=0, shuffle=True, drop_last=False, source="map")
    state.update(kw)
    return state


def test_base_state_has_skips_only_when_there_are_some() -> None:
    plain = base_state(1, 2, False, world=1, num_workers=2, batch_size=8, skips=Skips())
    assert plain == {
        "version": STATE_VERSION,
        "epoch": 1,
        "batches": 2,
        "world": 1,
        "num_workers": 2,
        "batch_size": 8,
        "writing": False,
    }
    skipped = base_state(1, 2, False, world=1, num_workers=2, batch_size=8, skips=Skips().add(3, 4))
    assert skipped["skips"] == Skips().add(3, 4).to_json()


@given(
    left=st.integers(0, 200),
    batches=st.integers(0, 60),
    batch_size=st.integers(1, 16),
    drop_last=st.booleans(),
)
def test_stream_received_counts_a_dropped_short_batch_as_received(
    left: int, batches: int, batch_size: int, drop_last: bool
) -> None:
    got = stream_received(left, batches, batch_size, drop_last)
    assert 0 <= got <= left
    if drop_last and left - min(batches * batch_size, left) < batch_size:
        assert got == left  # the rest is shorter than a batch: never handed out
    else:
        assert got == min(batches * batch_size, left)


def test_loaded_skips_join_only_in_the_same_batches() -> None:
    mine = Skips().add(0, 2)
    assert loaded_skips(mine, {"world": 9}, world=2, batch_size=4) is mine  # none in it
    joined = loaded_skips(mine, _state(), world=2, batch_size=4)
    assert joined.ranges == mine.union(Skips().add(5, 7)).ranges
    with pytest.raises(ResumeStateError, match=r"\(world size, batch size\) \(2, 4\)"):
        loaded_skips(mine, _state(), world=2, batch_size=8)
    with pytest.raises(ResumeStateError, match="the state's skips"):
        loaded_skips(mine, _state(skips="not ranges"), world=2, batch_size=4)


@pytest.mark.parametrize("key", ["seed", "shuffle", "drop_last"])
def test_check_map_settings_names_the_setting(key: str) -> None:
    mine = {"seed": 0, "shuffle": True, "drop_last": False}
    check_map_settings(_state(), **mine)  # type: ignore[arg-type]
    other = {**mine, key: {"seed": 1, "shuffle": False, "drop_last": True}[key]}
    with pytest.raises(ResumeStateError, match=f"{key}="):
        check_map_settings(_state(), **other)  # type: ignore[arg-type]


def _resume(state: dict[str, object], **kw: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        drop_last=False,
        writes=True,
        iterable=False,
        world=2,
        num_workers=1,
        batch_size=4,
        items=lambda: 40,
    )
    args.update(kw)
    return map_resume(state, **args)  # type: ignore[arg-type]


def test_map_resume_where_the_next_iter_goes_and_its_refusals() -> None:
    assert _resume(_state()) == {
        "writing": True,
        "epoch": 0,
        "batches": 3,
        "items": 40,
        "complete": False,
    }
    assert _resume(_state(batches=5))["complete"]  # 40 items / (2 ranks x 4) = 5 batches
    with pytest.raises(ResumeStateError, match="workers"):
        _resume(_state(), num_workers=2)
    _resume(_state(), num_workers=2, writes=False)  # merged: read back with any workers
    with pytest.raises(ResumeStateError, match="IterableDataset"):
        _resume(_state(source="iterable"), writes=False)
    with pytest.raises(ResumeStateError, match="40 items, this one has 41"):
        _resume(_state(), items=lambda: 41)


def test_map_resume_asks_for_the_items_only_once_the_shape_matches() -> None:
    asked: list[int] = []

    def items() -> int:
        asked.append(1)
        return 40

    with pytest.raises(ResumeStateError, match="batch size"):
        _resume(_state(), batch_size=8, items=items)
    assert asked == []
