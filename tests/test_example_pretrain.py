"""examples/pretrain_tokens.py runs (in this process, small): writes two token corpora,
mixes them per stream, trains, checkpoints, resumes, and checks every block once."""

from __future__ import annotations

import os
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_pretrain_tokens_example_resumes_every_block_once(tmp_path, monkeypatch, capsys):
    argv = ["pretrain_tokens.py", "--out", str(tmp_path / "w"), "--workers", "0"]
    monkeypatch.setattr(sys, "argv", [*argv, "--docs", "20", "--steps", "2"])
    runpy.run_path(os.path.join(ROOT, "examples", "pretrain_tokens.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "checkpoint after 2 batches" in out
    assert "every block of the epoch exactly once: True" in out
