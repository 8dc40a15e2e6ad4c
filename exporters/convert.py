"""From readings in NVML's units to metric families in dcgm-exporter's units and labels.

Pure functions of their arguments: no NVML, no clock, no threads. The tests feed them recorded
readings; the collector feeds them live ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from exporters.fields import Field
from exporters.model import DeviceInfo, RawGpu
from exporters.xid_messages import err_msg
from inferwatch import contract as c

MIB = 1024 * 1024


def gpu_labels(dev: DeviceInfo, hostname: str) -> dict[str, str]:
    """dcgm-exporter's identifying labels, in its order; Hostname only when known (as it does)."""
    labels = {
        c.L_GPU: str(dev.index),
        c.L_UUID: dev.uuid,
        c.L_PCI_BUS_ID: dev.pci_bus_id,
        # dcgm-exporter: fmt.Sprintf("nvidia%d", GPU index) (gpu_collector.go), not the minor number
        c.L_DEVICE: f"nvidia{dev.index}",
        c.L_MODEL_NAME: dev.name,
    }
    if hostname:
        labels[c.L_HOSTNAME] = hostname
    return labels


def dcgm_values(raw: RawGpu, last_xid: int) -> dict[str, float | int]:
    """The dcgm field values of one reading, keyed by metric name; unread fields are absent.

    Framebuffer figures are whole MiB, as dcgm-exporter reports them, each NVML byte figure
    floored on its own: FB_USED is NVML's ``used``, as DCGM reports it and nvidia-smi shows it,
    not a difference computed here (see the README's "FB_USED" decision).
    """
    v: dict[str, float | int] = {c.DCGM_XID_ERRORS.name: last_xid}
    if raw.mem_free is not None:
        v[c.DCGM_FB_FREE.name] = raw.mem_free // MIB
    if raw.mem_reserved is not None:
        v[c.DCGM_FB_RESERVED.name] = raw.mem_reserved // MIB
    if raw.mem_used is not None:
        v[c.DCGM_FB_USED.name] = raw.mem_used // MIB
    if raw.power_mw is not None:
        v[c.DCGM_POWER_USAGE.name] = raw.power_mw / 1000.0
    for metric, value in (
        (c.DCGM_GPU_UTIL, raw.util_gpu),
        (c.DCGM_MEM_COPY_UTIL, raw.util_mem),
        (c.DCGM_ENC_UTIL, raw.util_enc),
        (c.DCGM_DEC_UTIL, raw.util_dec),
        (c.DCGM_SM_CLOCK, raw.sm_clock),
        (c.DCGM_MEM_CLOCK, raw.mem_clock),
        (c.DCGM_GPU_TEMP, raw.gpu_temp),
        (c.DCGM_MEMORY_TEMP, raw.mem_temp),
        (c.DCGM_TOTAL_ENERGY, raw.energy_mj),
        (c.DCGM_PCIE_REPLAY, raw.pcie_replay),
        (c.DCGM_CORRECTABLE_REMAPPED_ROWS, raw.remap_correctable),
        (c.DCGM_UNCORRECTABLE_REMAPPED_ROWS, raw.remap_uncorrectable),
        (c.DCGM_ROW_REMAP_FAILURE, raw.remap_failure),
    ):
        if value is not None:
            v[metric.name] = value
    return v


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One GPU as the conversion needs it: its labels, its reading (None if it was not read)."""

    index: int
    labels: dict[str, str]
    raw: RawGpu | None
    # labels of the dcgm series: ``labels`` plus pod/namespace/container when the kubelet
    # allocated this GPU to exactly one container (None: same as ``labels``)
    dcgm_labels: dict[str, str] | None = None


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """GPU memory of the processes of one owner (a container, a pod, or nobody known) on one GPU."""

    gpu: int
    pod: str
    namespace: str
    container: str
    pod_uid: str
    container_id: str
    used_bytes: int


_UNREAD = RawGpu()


def _family(m: c.Metric, help_: str | None = None) -> Metric:
    return Metric(m.name, help_ or m.help, m.type)


def gpu_families(
    fields: Sequence[Field],
    rows: Sequence[GpuRow],
    xid_counts: Mapping[tuple[int, int], int],
    last_xid: Mapping[int, int],
    processes: Sequence[ProcessUsage],
) -> list[Metric]:
    """Every per-GPU family: the dcgm fields (only those with at least one sample), the total
    framebuffer in bytes, XID counts by code and per-owner process memory. A GPU whose reading
    is None keeps only its XID series."""
    # A GPU that could not be read still has its last XID: that is when it matters most.
    values = [(row, dcgm_values(row.raw or _UNREAD, last_xid.get(row.index, 0))) for row in rows]
    out: list[Metric] = []
    for f in fields:
        name = f.metric.name
        fam = _family(f.metric, f.help)
        xid = f.metric is c.DCGM_XID_ERRORS
        for row, vals in values:
            val = vals.get(name)
            if val is not None:
                labels = row.dcgm_labels or row.labels
                if xid:  # dcgm-exporter adds the code and its text (gpu_collector.go)
                    code = int(val)
                    labels = {**labels, c.L_ERR_CODE: str(code), c.L_ERR_MSG: err_msg(code)}
                fam.add_sample(name, labels, val)
        if fam.samples:
            out.append(fam)

    total = _family(c.GPU_FB_TOTAL_BYTES)
    for row, _ in values:
        if row.raw is not None and row.raw.mem_total is not None:
            total.add_sample(c.GPU_FB_TOTAL_BYTES.name, row.labels, row.raw.mem_total)
    out.append(total)

    by_index = {row.index: row.labels for row in rows}
    xids = _family(c.GPU_XID_ERRORS_TOTAL)
    for (gpu, xid), n in sorted(xid_counts.items()):
        if gpu in by_index:
            xids.add_sample(c.GPU_XID_ERRORS_TOTAL.name, {**by_index[gpu], "xid": str(xid)}, n)
    out.append(xids)

    procs = _family(c.GPU_PROCESS_MEMORY)
    for p in processes:
        if p.gpu in by_index:
            labels = {
                **by_index[p.gpu],
                c.L_POD: p.pod,
                c.L_NAMESPACE: p.namespace,
                c.L_CONTAINER: p.container,
                c.L_POD_UID: p.pod_uid,
                c.L_CONTAINER_ID: p.container_id,
            }
            procs.add_sample(c.GPU_PROCESS_MEMORY.name, labels, p.used_bytes)
    out.append(procs)
    return out


def health_families(
    backend: str,
    hostname: str,
    up: bool,
    errors: Mapping[tuple[str, str], int],
    scrape_seconds: float,
    host_pid: bool | None = None,
) -> list[Metric]:
    """The exporter's own health: which backend, whether it is up, errors by call and GPU."""
    info = _family(c.GPU_BACKEND_INFO)
    info.add_sample(c.GPU_BACKEND_INFO.name, {"backend": backend, c.L_HOSTNAME: hostname}, 1)
    up_fam = _family(c.GPU_BACKEND_UP)
    up_fam.add_sample(c.GPU_BACKEND_UP.name, {"backend": backend}, 1 if up else 0)
    errs = _family(c.GPU_BACKEND_ERRORS)
    for (call, gpu), n in sorted(errors.items()):
        errs.add_sample(c.GPU_BACKEND_ERRORS.name, {"call": call, c.L_GPU: gpu}, n)
    dur = _family(c.GPU_SCRAPE_DURATION)
    dur.add_sample(c.GPU_SCRAPE_DURATION.name, {}, scrape_seconds)
    out = [info, up_fam, errs, dur]
    if host_pid is not None:  # unknown (unreadable namespace link): left out rather than guessed
        pid = _family(c.GPU_HOST_PID_NAMESPACE)
        pid.add_sample(c.GPU_HOST_PID_NAMESPACE.name, {}, 1 if host_pid else 0)
        out.append(pid)
    return out
