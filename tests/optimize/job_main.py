"""``python -m tests.optimize.job_main ARGS_JSON``: one optimize job, as a separate process."""

from __future__ import annotations

import json
import sys

from asynccache import optimize
from asynccache.config import Settings
from tests.optimize import helpers


def main() -> None:
    a = json.loads(sys.argv[1])
    inputs = [(i, a["log_dir"], a["mode"]) for i in range(a["n"])]
    optimize(
        helpers.logged,
        inputs,
        a["url"],
        num_workers=a["workers"],
        num_shards=a["shards"],
        chunk_bytes=a.get("chunk_bytes", 4096),
        storage_options=a["storage_options"],
        settings=Settings.from_env(progress=False),
    )


if __name__ == "__main__":
    main()
