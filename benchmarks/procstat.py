"""What a process costs, read from /proc: the benchmarks' CPU and memory columns."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (a process that is gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / CLK_TCK


def memory_kib(pids: Iterable[int], field: str = "VmRSS") -> int:
    """A /proc/PID/status memory field (VmRSS, VmHWM) in KiB, summed over ``pids``."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return total
