"""Real-GPU check: the exporter's NVML figures and labels against ``nvidia-smi``, printed as a table.

On a machine with an NVIDIA GPU and driver:

    .venv/bin/python -m exporters.gpu_check --load     # starts the exporter with --backend nvml
    .venv/bin/python -m exporters.gpu_check --url http://127.0.0.1:9400   # checks a running one
    exporters/device_check.sh                          # the same, output kept for RESULTS.md

What one run proves on a healthy host, per GPU:
- labels by dcgm-exporter's rules: ``gpu`` is nvidia-smi's index, ``device`` is
  ``nvidia<index>``, ``UUID``, ``modelName``, ``pci_bus_id``, the driver-version label and
  ``Hostname`` as nvidia-smi and the host give them, the same on every dcgm series, no other
  label names; ``err_code``/``err_msg`` on the XID gauge;
- each field against ``nvidia-smi --query-gpu`` with tolerances in MiB for memory (not
  percent), and whether NVML's used + free + reserved adds up to the total (the FB_USED question);
- energy: the counter's growth over a few seconds against the power drawn meanwhile;
- processes: per-GPU process memory against ``--query-compute-apps``, and each process's owner
  (from its ``/proc/<pid>/cgroup``) against the exporter's owner labels; with ``--load`` a
  small CUDA process (the driver's own libcuda, no framework) holds memory on every GPU so there
  is something to compare; whether the exporter sees the host's PID namespace;
- health: backend up, every GPU up, no failed NVML call.
Exit code 0 when every row agrees; ``--json`` writes the rows for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from exporters.cgroups import host_pid_namespace, parse_cgroup
from exporters.xid_messages import err_msg
from inferwatch import contract as c
from inferwatch.net import free_port

MIB = 1024 * 1024
QUERY = [
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "driver_version",
    "memory.total",
    "memory.used",
    "memory.free",
    "memory.reserved",
    "utilization.gpu",
    "utilization.memory",
    "clocks.sm",
    "clocks.mem",
    "temperature.gpu",
    "temperature.memory",
    "power.draw",
]
OPTIONAL = {"memory.reserved", "temperature.memory"}  # older drivers do not know these
NA = ("", "[N/A]", "N/A", "[Not Supported]")
# dcgm-exporter's identity labels of a GPU series (render_metrics.go), plus its label field
DCGM_IDENTITY = {c.L_GPU, c.L_UUID, c.L_PCI_BUS_ID, c.L_DEVICE, c.L_MODEL_NAME, c.L_HOSTNAME}
DCGM_OPTIONAL = {c.L_DRIVER_VERSION, c.L_POD, c.L_NAMESPACE, c.L_CONTAINER}


@dataclass(frozen=True)
class Check:
    name: str
    metric: str
    smi: str
    abs_tol: float
    rel_tol: float = 0.0


# Memory in MiB, absolute: a few MiB move between the two reads on a busy GPU, none on an idle one.
CHECKS = [
    Check("FB total (MiB)", "fb_total_mib", "memory.total", 1),
    Check("FB used (MiB)", c.DCGM_FB_USED.name, "memory.used", 32),
    Check("FB free (MiB)", c.DCGM_FB_FREE.name, "memory.free", 32),
    Check("FB reserved (MiB)", c.DCGM_FB_RESERVED.name, "memory.reserved", 1),
    Check("GPU util (%)", c.DCGM_GPU_UTIL.name, "utilization.gpu", 15),
    Check("mem copy util (%)", c.DCGM_MEM_COPY_UTIL.name, "utilization.memory", 15),
    Check("SM clock (MHz)", c.DCGM_SM_CLOCK.name, "clocks.sm", 30, 0.1),
    Check("mem clock (MHz)", c.DCGM_MEM_CLOCK.name, "clocks.mem", 30, 0.02),
    Check("GPU temp (C)", c.DCGM_GPU_TEMP.name, "temperature.gpu", 3),
    Check("memory temp (C)", c.DCGM_MEMORY_TEMP.name, "temperature.memory", 3),
    Check("power (W)", c.DCGM_POWER_USAGE.name, "power.draw", 20, 0.15),
]


@dataclass
class Row:
    gpu: str
    figure: str
    exporter: str
    nvidia_smi: str
    ok: bool


def _run_smi(args: list[str]) -> str:
    out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(out.stdout.strip() or out.stderr.strip())
    return out.stdout


def nvidia_smi(fields: list[str]) -> list[dict[str, str]]:
    text = _run_smi([f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    return [dict(zip(fields, (v.strip() for v in row), strict=True)) for row in csv.reader(io.StringIO(text))]


def query_gpus() -> list[dict[str, str]]:
    try:
        return nvidia_smi(QUERY)
    except RuntimeError:
        return nvidia_smi([f for f in QUERY if f not in OPTIONAL])


def compute_apps() -> list[tuple[str, int, float]]:
    """(GPU UUID, pid, MiB) of every compute process nvidia-smi lists."""
    text = _run_smi(["--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"])
    out = []
    for row in csv.reader(io.StringIO(text)):
        if len(row) == 3 and row[1].strip().isdigit() and row[2].strip().isdigit():
            out.append((row[0].strip(), int(row[1]), float(row[2])))
    return out


def scrape(url: str) -> tuple[dict[str, Any], float]:
    """Parsed families by name, and the scrape's latency in seconds."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    latency = time.perf_counter() - t0
    return {f.name: f for f in text_string_to_metric_families(text)}, latency


def per_uuid(fams: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for fam in fams.values():
        for s in fam.samples:
            uuid = s.labels.get(c.L_UUID)
            if not uuid:
                continue
            if fam.name.startswith("DCGM_"):
                out.setdefault(uuid, {})[fam.name] = s.value
            elif fam.name == c.GPU_FB_TOTAL_BYTES.name:
                out.setdefault(uuid, {})["fb_total_mib"] = s.value / MIB
    return out


def health(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/healthz", timeout=10) as resp:
        return json.load(resp)


def start_exporter(hostname: str, log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "exporters", "--backend", "nvml", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--process-interval", "1", "--hostname", hostname]
    err = open(log_path, "wb") if log_path else subprocess.PIPE  # the child keeps its own copy
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    body: object = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log_path).read_text()[-2000:] if log_path else proc.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
            raise RuntimeError(f"exporter exited: {tail}")
        try:
            body = health(url)
            if body["backend_up"]:  # type: ignore[index]
                return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    raise RuntimeError(f"NVML did not come up within 60 s (last /healthz: {body})")


# A CUDA process from the driver's own library: a context and a buffer on every GPU, held until
# stdin closes. No framework needed, so it runs wherever the driver is installed. The primary
# context calls have kept their signatures across CUDA releases (cuCtxCreate has not).
HOLD = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
def ok(r, what):
    if r != 0:
        sys.exit(f"{what}: CUDA error {r}")
ok(cuda.cuInit(0), "cuInit")
n = ctypes.c_int()
ok(cuda.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
keep = []
for i in range(n.value):
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    ok(cuda.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
    ok(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1]) << 20)), "cuMemAlloc")
    keep.append((ctx, ptr))
print("holding", n.value, flush=True)
sys.stdin.read()
"""


def hold_gpu_memory(mib: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(mib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("holding"):
        proc.kill()
        _, err = proc.communicate(timeout=10)
        last = (err or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise RuntimeError(f"could not hold GPU memory with libcuda: {last[0]}")
    return proc


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Report:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def add(self, gpu: str, figure: str, ours: object, theirs: object, ok: bool) -> None:
        self.rows.append(Row(gpu, figure, str(ours), str(theirs), bool(ok)))

    @property
    def differing(self) -> int:
        return sum(not r.ok for r in self.rows)

    def table(self) -> str:
        cells = [("gpu", "figure", "exporter", "nvidia-smi", "")]
        cells += [(r.gpu, r.figure, r.exporter, r.nvidia_smi, "ok" if r.ok else "DIFF") for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(5)]
        return "\n".join(
            "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
        )


def check_labels(report: Report, g: dict[str, str], fams: dict[str, Any], hostname: str) -> None:
    """Every dcgm series of this GPU carries dcgm-exporter's identity, as nvidia-smi gives it."""
    idx = g["index"]
    expected = {
        c.L_GPU: idx,
        c.L_DEVICE: f"nvidia{idx}",
        c.L_MODEL_NAME: g["name"],
        c.L_PCI_BUS_ID: g.get("pci.bus_id", ""),
        c.L_HOSTNAME: hostname,
    }
    if g.get("driver_version", "") not in NA:
        expected[c.L_DRIVER_VERSION] = g["driver_version"]
    seen: dict[str, set[str]] = {k: set() for k in expected}
    bad_names: set[str] = set()
    xid_ok = True
    series = 0
    for fam in fams.values():
        if not fam.name.startswith("DCGM_"):
            continue
        for s in fam.samples:
            if s.labels.get(c.L_UUID) != g["uuid"]:
                continue
            series += 1
            for k in expected:
                seen[k].add(s.labels.get(k, "<absent>"))
            extra = {c.L_ERR_CODE, c.L_ERR_MSG} if fam.name == c.DCGM_XID_ERRORS.name else set()
            bad_names |= set(s.labels) - DCGM_IDENTITY - DCGM_OPTIONAL - extra
            if extra:
                code = int(s.value)
                labels = (s.labels.get(c.L_ERR_CODE), s.labels.get(c.L_ERR_MSG))
                xid_ok &= labels == (str(code), err_msg(code))
    report.add(idx, "dcgm series", series, "", series > 0)
    for k, want in expected.items():
        got = seen[k]
        report.add(idx, f"label {k}", ",".join(sorted(got)) or "absent", want, got == {want})
    report.add(idx, "label names", ",".join(sorted(bad_names)) or "dcgm-exporter's", "", not bad_names)
    report.add(idx, "XID err_code/err_msg", "match" if xid_ok else "mismatch", "", xid_ok)


def check_fields(report: Report, g: dict[str, str], ours: dict[str, Any]) -> None:
    idx = g["index"]
    for chk in CHECKS:
        theirs = g.get(chk.smi, "")
        mine = ours.get(chk.metric)
        if theirs in NA:
            report.add(idx, chk.name, mine, theirs or "not queried", mine is None)
            continue
        if mine is None:
            report.add(idx, chk.name, "absent", theirs, False)
            continue
        tol = max(chk.abs_tol, chk.rel_tol * float(theirs))
        report.add(idx, chk.name, f"{mine:g}", theirs, abs(mine - float(theirs)) <= tol)
    # The FB_USED question: with memory info v2, does NVML's used + free + reserved make the
    # total? Each figure is floored to MiB on its own, so up to 2 MiB short is still "yes".
    parts = [ours.get(m) for m in (c.DCGM_FB_USED.name, c.DCGM_FB_FREE.name, c.DCGM_FB_RESERVED.name)]
    total = ours.get("fb_total_mib")
    if None not in parts and total is not None:
        s = sum(parts)  # type: ignore[arg-type]
        report.add(idx, "used+free+reserved (MiB)", f"{s:g}", f"total {total:g}", 0 <= total - s <= 2)


def check_energy(
    report: Report, idx: str, e1: float | None, e2: float | None, dt: float, watts: list[float]
) -> None:
    """The counter's growth (mJ) over dt against the power drawn meanwhile: same magnitude."""
    if e1 is None or e2 is None or not watts:
        report.add(idx, "energy (mJ) vs power", "absent", "", False)
        return
    from_counter = (e2 - e1) / 1000 / dt  # W
    mean_power = statistics.fmean(watts)
    ok = e2 > e1 and abs(from_counter - mean_power) <= max(15.0, 0.3 * mean_power)
    report.add(
        idx, "energy (mJ) vs power", f"{from_counter:.1f} W over {dt:.1f} s", f"{mean_power:.1f} W", ok
    )


def check_processes(
    report: Report, g: dict[str, str], fams: dict[str, Any], apps: list[tuple[str, int, float]]
) -> None:
    idx, uuid = g["index"], g["uuid"]
    procs = fams.get(c.GPU_PROCESS_MEMORY.name)
    samples = [s for s in procs.samples if s.labels.get(c.L_UUID) == uuid] if procs else []
    mine = sum(s.value for s in samples) / MIB
    theirs = [a for a in apps if a[0] == uuid]
    total = sum(a[2] for a in theirs)
    # nvidia-smi floors each process to MiB: allow 1 MiB per process
    report.add(idx, "process memory (MiB)", f"{mine:g}", f"{total:g}", abs(mine - total) <= len(theirs) + 1)
    owners_ours = {(s.labels.get(c.L_POD_UID, ""), s.labels.get(c.L_CONTAINER_ID, "")) for s in samples}
    owners_theirs = set()
    for _, pid, _ in theirs:
        try:
            owner = parse_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
        except OSError:
            owner = None
        owners_theirs.add((owner.pod_uid, owner.container_id) if owner else ("", ""))
    fmt = ";".join(f"{u or '-'}/{i[:12] or '-'}" for u, i in sorted(owners_theirs))
    fmt_ours = ";".join(f"{u or '-'}/{i[:12] or '-'}" for u, i in sorted(owners_ours))
    report.add(idx, "process owners", fmt_ours or "none", fmt or "none", owners_ours == owners_theirs)


def run_checks(url: str, hostname: str, energy_s: float) -> tuple[Report, dict[str, Any]]:
    report = Report()
    scrape(url)  # warm-up
    fams, _ = scrape(url)
    smi = query_gpus()
    ours = per_uuid(fams)
    t0 = time.monotonic()
    e1 = {u: v.get(c.DCGM_TOTAL_ENERGY.name) for u, v in ours.items()}
    watts: dict[str, list[float]] = {}
    while time.monotonic() - t0 < energy_s:
        time.sleep(0.5)
        for u, v in per_uuid(scrape(url)[0]).items():
            if c.DCGM_POWER_USAGE.name in v:
                watts.setdefault(u, []).append(v[c.DCGM_POWER_USAGE.name])
    last = per_uuid(scrape(url)[0])
    dt = time.monotonic() - t0
    apps = compute_apps()
    body = health(url)
    for g in smi:
        mine = ours.get(g["uuid"])
        if mine is None:
            report.add(g["index"], "present", "missing", g["uuid"], False)
            continue
        check_labels(report, g, fams, hostname)
        check_fields(report, g, mine)
        e2 = last.get(g["uuid"], {}).get(c.DCGM_TOTAL_ENERGY.name)
        check_energy(report, g["index"], e1.get(g["uuid"]), e2, dt, watts.get(g["uuid"], []))
        check_processes(report, g, fams, apps)
    up = fams.get(c.GPU_UP.name)
    down = sorted(s.labels.get(c.L_GPU, "") for s in up.samples if s.value != 1) if up else ["absent"]
    report.add("", "GPUs up", "all" if not down else ",".join(down), f"{len(smi)} GPUs", not down)
    report.add("", "backend_up", body.get("backend_up"), "True", body.get("backend_up") is True)
    errs = fams.get(c.GPU_BACKEND_ERRORS.name[: -len("_total")])
    failed = sorted(f"{s.labels['call']}[{s.labels['gpu']}]" for s in errs.samples) if errs else []
    report.add("", "failed NVML calls", ",".join(failed) or "none", "none", not failed)
    ns = fams.get(c.GPU_HOST_PID_NAMESPACE.name)
    ours_ns = [s.value for s in ns.samples] if ns else []
    mine_ns = host_pid_namespace()  # the check runs beside the exporter: the same answer is due
    want_ns = [] if mine_ns is None else [1 if mine_ns else 0]
    report.add("", "host PID namespace", ours_ns or "absent", mine_ns, ours_ns == want_ns)
    return report, {"healthz": body, "gpus": smi, "compute_apps": apps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="check a running exporter at this URL instead of starting one")
    ap.add_argument(
        "--hostname",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="the Hostname label expected (default: the exporter's own default, %(default)s)",
    )
    ap.add_argument(
        "--load", action="store_true", help="hold 256 MiB on every GPU from a CUDA process during the check"
    )
    ap.add_argument("--energy-seconds", type=float, default=5.0, help="how long to watch the energy counter")
    ap.add_argument("--json", help="also write the rows and what nvidia-smi said to this file")
    ap.add_argument("--exporter-log", help="write the started exporter's log lines to this file")
    args = ap.parse_args(argv)
    if shutil.which("nvidia-smi") is None:
        print(
            "gpu_check: error: nvidia-smi not found; this check needs a machine with an NVIDIA GPU",
            file=sys.stderr,
        )
        return 2
    proc = holder = None
    try:
        if args.load:
            holder = hold_gpu_memory(256)
        if args.url:
            url = args.url.rstrip("/")
        else:
            proc, url = start_exporter(args.hostname, args.exporter_log)
        if holder is not None:
            time.sleep(3)  # the exporter lists processes every second here; let it see the holder
        report, seen = run_checks(url, args.hostname, args.energy_seconds)
        latencies = sorted(scrape(url)[1] for _ in range(30))
        print(report.table())
        p50, worst = statistics.median(latencies) * 1000, latencies[-1] * 1000
        print(f"\nscrape latency over 30 scrapes: P50 {p50:.2f} ms, max {worst:.2f} ms")
        rss = rss_mib(proc.pid) if proc is not None else None
        if rss is not None:
            print(f"exporter resident memory: {rss:.1f} MiB")
        print(f"healthz: {json.dumps(seen['healthz'])}")
        print(f"rows differing: {report.differing}")
        if args.json:
            Path(args.json).write_text(
                json.dumps(
                    {
                        "rows": [asdict(r) for r in report.rows],
                        "differing": report.differing,
                        "scrape_ms": {"p50": round(p50, 3), "max": round(worst, 3)},
                        "rss_mib": rss,
                        **seen,
                    },
                    indent=2,
                )
            )
        return 0 if report.differing == 0 else 1
    except (RuntimeError, OSError) as exc:  # no NVML, no libcuda, an exporter that died: one line
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(10)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
