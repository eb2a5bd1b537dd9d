"""What the benchmarks share: the line that says which machine and load a figure comes
from, aligned text tables, and a broker to run against.

Imported by the benchmark scripts as ``from harness import ...`` (a script's own folder
is first on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from typing import Iterator, Sequence


def cpu_name() -> str:
    """The CPU's model name and its widest vector extension, e.g. ``Intel(R) Xeon(R)
    Processor (avx512f)``: figures move with it (docs/ say which machine each came from)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    return f"{name} ({'avx512f' if 'avx512f' in flags else 'avx2' if 'avx2' in flags else 'no avx2'})"


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, e.g. ``0.61 1.32 1.98``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def print_aligned(header: Sequence[object], rows: Sequence[Sequence[object]]) -> None:
    """A text table, every column right-aligned to its widest cell."""
    table = [[str(x) for x in row] for row in (header, *rows)]
    widths = [max(len(x) for x in col) for col in zip(*table)]
    for row in table:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


@contextlib.contextmanager
def benchmark_kafka(workdir: str, *, nodes: int = 1, heap: str = "1g") -> Iterator[str]:
    """The bootstrap address to benchmark against: ``KAFKA_BOOTSTRAP_SERVERS`` when set,
    else a broker of our launcher started under ``workdir`` (stopped on exit)."""
    from rollway.broker import LocalKafka, external_bootstrap

    bootstrap = external_bootstrap()
    if bootstrap:
        yield bootstrap
        return
    kafka = LocalKafka(f"{workdir}/kafka", nodes=nodes, heap=heap)
    bootstrap = kafka.start(timeout=120)
    try:
        yield bootstrap
    finally:
        kafka.stop()
