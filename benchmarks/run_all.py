"""Run the named benchmarks in turn, small sizes by default (``make bench``).

Each runs as its own subprocess (so one's memory, threads and servers never touch the
next), with its output shown as it comes; at the end the tables of all of them are printed
again, together, each under its command line, with the load average before and after it.
Every benchmark measures the limits it is compared with in its own run and prints its
figures as ratios to them; ``limits`` runs first, so the summary starts with the limits of
this machine. The scripts in ``probes/`` are not run: see ``benchmarks/README.md``.

    python benchmarks/run_all.py            # small sizes: about ten minutes on 2 cores
    python benchmarks/run_all.py --full     # the scripts' own defaults (much longer)
    python benchmarks/run_all.py --only streaming_epoch fetcher_overlap
    python benchmarks/run_all.py --list     # the names and commands, nothing run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from limits import loadavg

HERE = Path(__file__).resolve().parent

# (name, script, small-size arguments). --full drops the arguments.
BENCHMARKS: list[tuple[str, str, list[str]]] = [
    ("limits", "limits.py", ["--total-mb", "128", "--chunk-mb", "16"]),
    ("streaming_epoch", "streaming_epoch.py", ["--total-mb", "256", "--chunk-mb", "16"]),
    ("download_cold", "download_cold.py", ["--total-mib", "128", "--chunk-mib", "8", "64"]),
    (
        "first_batch",
        "first_batch.py",
        ["--total-mb", "128", "--chunk-mb", "16", "--reps", "2", "--no-range-rows"],
    ),
    (
        "link_regime",
        "link_regime.py",
        ["--total-mb", "128", "--links", "20:8", "--reps", "1", "--part-mib", "--skip-epoch"],
    ),
    ("fetcher_overlap", "fetcher_overlap.py", ["--n", "30"]),
    (
        "fetcher_overlap_streaming",
        "fetcher_overlap.py",
        ["--source", "streaming", "--total-mb", "128", "--chunk-mb", "8"],
    ),
    (
        "optimize_throughput",
        "optimize_throughput.py",
        ["--total-mb", "256", "--chunk-mb", "16", "--reps", "1"],
    ),
    (
        "tokens",
        "tokens.py",
        ["--total-mb", "32", "--chunk-mb", "4", "--reps", "1", "--shuffle", "on,off"],
    ),
    ("budget_epochs", "budget_epochs.py", ["--total-mb", "128", "--chunk-mb", "1", "--reps", "1"]),
    ("memory", "memory_by_process.py", ["--total-mb", "256", "--chunk-mb", "16"]),
    ("index_scale", "index_scale.py", ["--sizes", "10000,100000", "--e2e-chunks", "2000"]),
]


def run_one(script: str, args: list[str]) -> tuple[int, list[str], float]:
    """Runs one script, echoing its output; returns (exit code, output lines, seconds)."""
    cmd = [sys.executable, str(HERE / script), *args]
    env = dict(os.environ, ASYNCCACHE_PROGRESS="0", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    lines: list[str] = []
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE.parent
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lines.append(line.rstrip("\n"))
        code = proc.wait()
    return code, lines, time.perf_counter() - started


def tables(lines: list[str]) -> list[str]:
    """Markdown table rows, plus the line just before each table (its caption)."""
    out: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith("|"):
            if i == 0 or not lines[i - 1].startswith("|"):  # a new table starts
                caption = next((p for p in reversed(lines[:i]) if p.strip()), "")
                out += ["", caption] if caption and not caption.startswith("|") else [""]
            out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=[b[0] for b in BENCHMARKS], help="run these")
    ap.add_argument("--full", action="store_true", help="the scripts' default sizes")
    ap.add_argument("--list", action="store_true", help="print the names and commands only")
    args = ap.parse_args()
    chosen = [b for b in BENCHMARKS if not args.only or b[0] in args.only]
    if args.list:
        for name, script, small in chosen:
            print(f"{name}: python benchmarks/{script} {' '.join([] if args.full else small)}")
        return
    summary: list[str] = []
    failed: list[str] = []
    for name, script, small in chosen:
        argv = [] if args.full else small
        shown = " ".join(["python", f"benchmarks/{script}", *argv])
        before = loadavg()
        print(f"\n=== {name}: {shown}  (load {before})", flush=True)
        code, lines, seconds = run_one(script, argv)
        after = loadavg()
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        summary += [
            f"\n### {name}: `{shown}`",
            f"{status}, {seconds:.0f} s, load {before} -> {after}",
        ]
        summary += tables(lines)
        if code != 0:
            failed.append(name)
    print("\n\n## Summary\n" + "\n".join(summary))
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
