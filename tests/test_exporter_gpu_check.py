"""The real-GPU check script's comparison, run here against the simulated exporter.

These machines have no GPU, so ``nvidia-smi`` is replaced by a stand-in that answers from the
exporter's own figures (optionally skewed). This proves the script's plumbing and verdicts
before a GPU machine runs it; it proves nothing about NVML itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from inferwatch import contract as c
from tests.fixtures.gpu_exporter import RunningExporter

STAND_IN = """#!{python}
import os, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
text = urllib.request.urlopen(os.environ["STANDIN_URL"] + "/metrics").read().decode()
v = {{}}
for fam in text_string_to_metric_families(text):
    for s in fam.samples:
        if "UUID" in s.labels and s.name.startswith("DCGM_FI_DEV_GPU_UTIL"):
            v.setdefault(s.labels["gpu"], {{}}).update(
                uuid=s.labels["UUID"], name=s.labels["modelName"], bus=s.labels["pci_bus_id"],
                driver=s.labels.get("DCGM_FI_DRIVER_VERSION", "[N/A]"),
            )
        if "UUID" in s.labels:
            v.setdefault(s.labels["gpu"], {{}})[s.name] = s.value
skew = float(os.environ.get("STANDIN_SKEW_MIB", "0"))
arg = sys.argv[1]
if arg.startswith("--query-compute-apps"):
    sys.exit(0)
fields = arg.split("=", 1)[1].split(",")
smi = {{
    "index": lambda g, d: g,
    "uuid": lambda g, d: d["uuid"],
    "name": lambda g, d: d["name"],
    "pci.bus_id": lambda g, d: d["bus"],
    "driver_version": lambda g, d: d["driver"],
    "memory.total": lambda g, d: int(d["{total}"] / 2**20 + skew),
    "memory.used": lambda g, d: int(d["{used}"]),
    "memory.free": lambda g, d: int(d["{free}"]),
    "memory.reserved": lambda g, d: int(d["{reserved}"]),
    "utilization.gpu": lambda g, d: int(d["{util}"]),
    "utilization.memory": lambda g, d: int(d["{mem_util}"]),
    "clocks.sm": lambda g, d: int(d["{sm}"]),
    "clocks.mem": lambda g, d: int(d["{mem_clock}"]),
    "temperature.gpu": lambda g, d: int(d["{temp}"]),
    "temperature.memory": lambda g, d: int(d["{mem_temp}"]),
    "power.draw": lambda g, d: "%.2f" % d["{power}"],
}}
for g, d in sorted(v.items()):
    print(", ".join(str(smi[f](g, d)) for f in fields))
"""


def stand_in(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(
        STAND_IN.format(
            python=sys.executable,
            total=c.GPU_FB_TOTAL_BYTES.name,
            used=c.DCGM_FB_USED.name,
            free=c.DCGM_FB_FREE.name,
            reserved=c.DCGM_FB_RESERVED.name,
            util=c.DCGM_GPU_UTIL.name,
            mem_util=c.DCGM_MEM_COPY_UTIL.name,
            sm=c.DCGM_SM_CLOCK.name,
            mem_clock=c.DCGM_MEM_CLOCK.name,
            temp=c.DCGM_GPU_TEMP.name,
            mem_temp=c.DCGM_MEMORY_TEMP.name,
            power=c.DCGM_POWER_USAGE.name,
        )
    )
    script.chmod(0o755)
    return bin_dir


def run_check(exp: RunningExporter, bin_dir: Path, skew_mib: int = 0) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "STANDIN_URL": exp.url,
        "STANDIN_SKEW_MIB": str(skew_mib),
    }
    return subprocess.run(
        [sys.executable, "-m", "exporters.gpu_check", "--url", exp.url],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_check_agrees_with_an_nvidia_smi_that_reports_the_same_gpus(
    gpu_exporter: RunningExporter, tmp_path: Path
) -> None:
    gpu_exporter.simulate(load=0.6)  # steady values between the two reads
    proc = run_check(gpu_exporter, stand_in(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["gpu", "figure", "exporter", "nvidia-smi"]
    for figure in (
        "FB total (MiB)",
        "FB reserved (MiB)",
        "used+free+reserved (MiB)",
        "power (W)",
        "energy (mJ) vs power",
        "label device",
        "label modelName",
        "label pci_bus_id",
        "label Hostname",
        "label names",
        "process owners",
    ):
        assert sum(figure in line and line.rstrip().endswith("ok") for line in lines) == 2, figure
    assert "rows differing: 0" in proc.stdout


def test_check_fails_and_shows_the_row_that_differs(gpu_exporter: RunningExporter, tmp_path: Path) -> None:
    gpu_exporter.simulate(load=0.6)
    proc = run_check(gpu_exporter, stand_in(tmp_path), skew_mib=4096)
    assert proc.returncode == 1
    diffs = [line for line in proc.stdout.splitlines() if line.rstrip().endswith("DIFF")]
    assert len(diffs) == 2 and all("FB total (MiB)" in line for line in diffs)


def test_check_without_nvidia_smi_says_so(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "exporters.gpu_check"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": str(tmp_path)},
        timeout=60,
    )
    assert proc.returncode == 2
    assert "nvidia-smi not found" in proc.stderr


IDENTITY = (
    'gpu="0",UUID="GPU-a",pci_bus_id="00000000:9A:00.0",device="{device}",'
    'modelName="NVIDIA H100 80GB HBM3",Hostname="node-a",DCGM_FI_DRIVER_VERSION="580.95.05"'
)
SERIES = (
    "# TYPE DCGM_FI_DEV_GPU_UTIL gauge\n"
    f"DCGM_FI_DEV_GPU_UTIL{{{{{IDENTITY}}}}} 87\n"
    "# TYPE DCGM_FI_DEV_XID_ERRORS gauge\n"
    f'DCGM_FI_DEV_XID_ERRORS{{{{{IDENTITY},err_code="79",err_msg="{{msg}}"{{extra}}}}}} 79\n'
)
SMI_ROW = {
    "index": "0",
    "uuid": "GPU-a",
    "name": "NVIDIA H100 80GB HBM3",
    "pci.bus_id": "00000000:9A:00.0",
    "driver_version": "580.95.05",
}


def label_rows(device: str = "nvidia0", msg: str = "GPU has fallen off the bus", extra: str = "") -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    from exporters.gpu_check import Report, check_labels

    text = SERIES.format(device=device, msg=msg, extra=extra)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    report = Report()
    check_labels(report, SMI_ROW, fams, "node-a")
    return {r.figure: r.ok for r in report.rows}


def test_label_check_passes_dcgm_exporters_labels() -> None:
    assert all(label_rows().values()), label_rows()


def test_label_check_catches_the_minor_number_in_device_a_wrong_err_msg_and_stray_labels() -> None:
    rows = label_rows(device="nvidia4")  # what the exporter wrote before issue 20
    assert rows["label device"] is False and rows["label gpu"] is True
    assert label_rows(msg="Unknown Error")["XID err_code/err_msg"] is False
    assert label_rows(extra=',minor="4"')["label names"] is False


def test_check_without_libcuda_says_so_in_one_line(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexit 0\n")
    smi.chmod(0o755)
    proc = subprocess.run(
        [sys.executable, "-m", "exporters.gpu_check", "--load"],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"},
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("gpu_check: error: could not hold GPU memory with libcuda: ")
    assert len(proc.stderr.strip().splitlines()) == 1
