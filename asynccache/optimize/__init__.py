"""Building datasets in parallel, straight into storage: :func:`optimize`.

The per-shard API, for running the shards on another engine (Ray, Dask, Spark, a
``concurrent.futures`` pool): :func:`start_job` claims the output and plans the shards,
:func:`write_shard` writes one shard wherever it runs, ``JobRun.merge`` (or
:func:`merge_shards`) commits ``index.json``. See docs/optimize.md.
"""

from .api import JobRun, OptimizeResult, merge_shards, optimize, start_job
from .job import Job
from .shard import ShardResult, write_shard

__all__ = [
    "Job",
    "JobRun",
    "OptimizeResult",
    "ShardResult",
    "merge_shards",
    "optimize",
    "start_job",
    "write_shard",
]
