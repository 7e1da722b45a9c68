"""One rank of the Lightning end-to-end test (started by test_lightning.py with the
launcher's environment: MASTER_ADDR/PORT, WORLD_SIZE, RANK, LOCAL_RANK, NODE_RANK).

Run 1 trains until ``stop`` steps, ModelCheckpoint saving at that step; run 2 is a new
Trainer, model and dataset resuming from that checkpoint with ``ckpt_path``. Each run's
sample keys go to ``{out}/run{n}-rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from asynccache import CacheDataLoader, StreamingDataset


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen: list[int] = []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.extend(batch["i"].tolist())
        return self.layer(batch["x"]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(cfg: dict) -> CacheDataLoader:
    rank = os.environ["RANK"]
    ds = StreamingDataset(
        cfg["url"],
        cache_dir=os.path.join(cfg["out"], f"cache{rank}"),
        storage_options=cfg["storage_options"],
        shuffle=True,
        seed=7,
    )
    return CacheDataLoader(ds, batch_size=cfg["batch_size"])


def trainer(cfg: dict, **kw: object) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=cfg["out"],
        **kw,
    )


def main(cfg: dict) -> None:
    warnings.simplefilter("ignore")
    rank = os.environ["RANK"]
    ckpt_dir = os.path.join(cfg["out"], "ckpt")
    stop = cfg["stop"]
    model = Tiny()
    trainer(
        cfg,
        max_steps=stop,
        callbacks=[
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="mid", every_n_train_steps=stop, save_top_k=-1
            )
        ],
    ).fit(model, train_dataloaders=loader(cfg))
    with open(os.path.join(cfg["out"], f"run1-rank{rank}.json"), "w") as f:
        json.dump(model.seen, f)
    model = Tiny()
    trainer(cfg).fit(
        model, train_dataloaders=loader(cfg), ckpt_path=os.path.join(ckpt_dir, "mid.ckpt")
    )
    with open(os.path.join(cfg["out"], f"run2-rank{rank}.json"), "w") as f:
        json.dump(model.seen, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
