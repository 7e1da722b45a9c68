"""Pretrain a tiny language model on a weighted mix of two token corpora, then resume.

    python examples/pretrain_tokens.py [--steps 12] [--workers 2] [--s3] [--out DIR]

1. writes two small token corpora ("web": random tokens; "code": a repeating pattern
   with noise) with ``optimize(..., tokens="uint16")``, to a directory or, with ``--s3``,
   to a bucket of a real S3 server (SeaweedFS) started on loopback;
2. mixes them 70/30 with ``MixedDataset`` in ``per_stream`` mode (every batch from one
   source, tagged with its stream, for per-source loss logging), each read as blocks of
   65 tokens (``TokenBlocks``: 64 inputs plus the shifted target);
3. trains a tiny model for ``--steps`` steps through the ``Fetcher``, checkpoints the
   model, the optimiser and the loader's position at the middle step, and "crashes";
4. builds everything anew, loads the checkpoint and finishes the epoch: every block of
   the epoch is trained on exactly once across the restart, which it checks.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil

import numpy as np
import torch
from torch import nn

from asynccache import (
    CacheDataLoader,
    Fetcher,
    MixedDataset,
    Settings,
    Stream,
    StreamingDataset,
    TokenBlocks,
    optimize,
)

VOCAB, BLOCK, BATCH = 512, 65, 8
SOURCES = {"web": 0.7, "code": 0.3}


def web_doc(i: int) -> np.ndarray:
    """Document ``i`` of the web corpus: random tokens, a few hundred of them."""
    rng = np.random.default_rng([1, i])
    return rng.integers(0, VOCAB, int(rng.integers(50, 600))).astype(np.uint16)


def code_doc(i: int) -> np.ndarray:
    """Document ``i`` of the code corpus: a repeating pattern with some noise."""
    rng = np.random.default_rng([2, i])
    pattern = np.tile(np.arange(16, dtype=np.uint16) * 7 % VOCAB, 40)
    noise = rng.random(len(pattern)) < 0.1
    pattern[noise] = rng.integers(0, VOCAB, int(noise.sum()))
    return pattern[: int(rng.integers(100, 640))]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.mix = nn.Linear(64, 64)
        self.out = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mix(self.embed(tokens))))


def loader(urls: dict[str, str], cache: str, opts: dict, workers: int) -> CacheDataLoader:
    streams = [
        Stream(
            StreamingDataset(
                urls[name],
                cache_dir=cache,
                shuffle=True,
                seed=s,
                storage_options=opts,
                item_loader=TokenBlocks(block_size=BLOCK),
            ),
            weight=w,
        )
        for s, (name, w) in enumerate(SOURCES.items())
    ]
    mix = MixedDataset(streams, mode="per_stream", batch_size=BATCH, seed=0, tag=True)
    return CacheDataLoader(mix, batch_size=BATCH, num_workers=workers)


def step(model: TinyLM, opt: torch.optim.Optimizer, blocks: torch.Tensor) -> float:
    tokens = blocks.long()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def train(dl: CacheDataLoader, model: TinyLM, opt: torch.optim.Optimizer, stop: int | None,
          checkpoint: str) -> tuple[list[bytes], int]:  # fmt: skip
    """Train until ``stop`` batches (then checkpoint) or the end of the epoch; returns the
    blocks trained on and the batches run."""
    seen: list[bytes] = []
    losses: dict[int, list[float]] = collections.defaultdict(list)
    names = list(SOURCES)
    n = 0
    with Fetcher(dl, prefetch_batches=2) as fetcher:
        for stream, blocks in fetcher:
            assert len(set(stream.tolist())) == 1, "per_stream: one source per batch"
            losses[int(stream[0])].append(step(model, opt, blocks))
            seen += [bytes(b.numpy().tobytes()) for b in blocks]
            n += 1
            if n == stop:
                state = {"model": model.state_dict(), "opt": opt.state_dict(),
                         "loader": fetcher.state_dict()}  # fmt: skip
                torch.save(state, checkpoint)
                print(f"   checkpoint after {n} batches -> {checkpoint}")
                break
    for s, ls in sorted(losses.items()):
        print(f"   {names[s]:>4}: {len(ls)} batches, mean loss {np.mean(ls):.3f}")
    return seen, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="batches before the checkpoint")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--docs", type=int, default=120, help="documents per corpus")
    parser.add_argument("--s3", action="store_true", help="read from a local S3 server")
    parser.add_argument("--out", default="asynccache-pretrain", help="work directory")
    args = parser.parse_args()
    work = os.path.abspath(args.out)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    quiet = Settings.from_env(progress=False)
    with contextlib.ExitStack() as stack:
        opts: dict = {}
        if args.s3:
            from asynccache.testing import ObjectStore

            store = stack.enter_context(ObjectStore())
            store.create_bucket("corpus")
            opts = store.storage_options
        urls = {}
        for name, fn in (("web", web_doc), ("code", code_doc)):
            urls[name] = f"s3://corpus/{name}" if args.s3 else os.path.join(work, name)
            optimize(fn, list(range(args.docs)), urls[name], num_workers=0,
                     chunk_bytes=16 << 10, tokens="uint16", storage_options=opts,
                     settings=quiet)  # fmt: skip
        print(f"1. wrote two token corpora of {args.docs} documents: {', '.join(urls.values())}")

        cache = os.path.join(work, "cache")
        whole = loader(urls, cache, opts, args.workers)
        mix = whole.dataset
        print(f"2. mix of {mix.stream_counts} blocks of {BLOCK} tokens, {len(whole)} batches")

        checkpoint = os.path.join(work, "checkpoint.pt")
        torch.manual_seed(0)
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        print(f"3. training {args.steps} steps, then a checkpoint and a crash")
        before, _ = train(whole, model, opt, args.steps, checkpoint)
        del whole, model, opt

        print("4. a new process: everything built anew, the checkpoint loaded")
        dl = loader(urls, cache, opts, args.workers)
        model = TinyLM()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        dl.load_state_dict(state["loader"])
        after, n = train(dl, model, opt, None, checkpoint)

        want = collections.Counter(
            bytes(b.numpy().tobytes())
            for _s, blocks in loader(urls, os.path.join(work, "cache"), opts, 0)
            for b in blocks
        )
        got = collections.Counter(before + after)
        ok = got == want
        print(f"   resumed: {n} more batches; every block of the epoch exactly once: {ok}")
        if not ok:
            raise SystemExit("the resumed epoch differs from an uninterrupted one")


if __name__ == "__main__":
    main()
