"""From NVML readings to dcgm-exporter's units and labels, without hardware; the fields file; the renderer."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client.metrics_core import Metric

from exporters.convert import GpuRow, ProcessUsage, gpu_families, gpu_labels, health_families
from exporters.exposition import render
from exporters.fields import DEFAULT_FIELDS, FieldsError, load_fields, parse_fields
from exporters.model import DeviceInfo, RawGpu
from inferwatch import contract as c
from tests.fixtures.gpu_exporter import parse_families

MIB = 1024 * 1024
FIELDS = load_fields()
H100 = DeviceInfo(
    3, "GPU-0f5c8a71-2d4e-4b7a-9c1d-8e6f5a4b3c2d", "NVIDIA H100 80GB HBM3", 3, "00000000:9A:00.0"
)
# One reading in NVML's units, shaped like what an H100 SXM returns under load: memory v2 in
# bytes (free deliberately not a whole MiB), power in mW, energy in mJ.
H100_READING = RawGpu(
    mem_total=85520809984,  # 81559 MiB
    mem_reserved=555745280,  # 530 MiB
    mem_free=40000000000,  # 38146.97 MiB
    mem_used=85520809984 - 555745280 - 40000000000,
    util_gpu=87,
    util_mem=41,
    util_enc=0,
    util_dec=0,
    sm_clock=1980,
    mem_clock=2619,
    gpu_temp=61,
    mem_temp=70,
    power_mw=612345,
    energy_mj=123456789012,
    pcie_replay=2,
    remap_correctable=1,
    remap_uncorrectable=0,
    remap_failure=0,
)


def values(fams: list[Metric], gpu: str = "3") -> dict[str, float]:
    return {f.name: s.value for f in fams for s in f.samples if s.labels.get(c.L_GPU) == gpu}


def test_recorded_h100_reading_converts_to_dcgm_units() -> None:
    labels = gpu_labels(H100, "node-a")
    assert list(labels.items()) == [  # dcgm-exporter's names and order (render_metrics.go)
        ("gpu", "3"),
        ("UUID", H100.uuid),
        ("pci_bus_id", "00000000:9A:00.0"),
        ("device", "nvidia3"),
        ("modelName", "NVIDIA H100 80GB HBM3"),
        ("Hostname", "node-a"),
    ]
    fams = gpu_families(FIELDS, [GpuRow(3, labels, H100_READING)], {}, {}, [])
    v = values(fams)
    assert v[c.DCGM_FB_FREE.name] == 38146
    assert v[c.DCGM_FB_RESERVED.name] == 530
    # NVML's own used, floored to MiB as DCGM does; each figure floored alone, so the three
    # add up to the total within 2 MiB
    assert v[c.DCGM_FB_USED.name] == H100_READING.mem_used // MIB == 42882
    assert 81559 - 2 <= v[c.DCGM_FB_USED.name] + v[c.DCGM_FB_FREE.name] + v[c.DCGM_FB_RESERVED.name] <= 81559
    assert v[c.GPU_FB_TOTAL_BYTES.name] == 85520809984
    assert v[c.DCGM_POWER_USAGE.name] == pytest.approx(612.345)
    assert v[c.DCGM_TOTAL_ENERGY.name] == 123456789012
    assert v[c.DCGM_GPU_UTIL.name] == 87 and v[c.DCGM_MEM_COPY_UTIL.name] == 41
    assert v[c.DCGM_SM_CLOCK.name] == 1980 and v[c.DCGM_MEM_CLOCK.name] == 2619
    assert v[c.DCGM_GPU_TEMP.name] == 61 and v[c.DCGM_MEMORY_TEMP.name] == 70
    assert v[c.DCGM_PCIE_REPLAY.name] == 2
    assert v[c.DCGM_CORRECTABLE_REMAPPED_ROWS.name] == 1
    assert v[c.DCGM_UNCORRECTABLE_REMAPPED_ROWS.name] == 0
    assert v[c.DCGM_ROW_REMAP_FAILURE.name] == 0
    assert v[c.DCGM_XID_ERRORS.name] == 0  # no XID yet
    assert {f.name: f.type for f in fams if f.name.startswith("DCGM")} == {
        f.metric.name: f.metric.type for f in FIELDS
    }


def test_an_unread_value_drops_only_its_own_series() -> None:
    reading = replace(H100_READING, mem_temp=None)
    other = DeviceInfo(4, "GPU-aaaaaaaa-2d4e-4b7a-9c1d-8e6f5a4b3c2d", "NVIDIA H100 80GB HBM3", 4)
    rows = [
        GpuRow(3, gpu_labels(H100, ""), reading),
        GpuRow(4, gpu_labels(other, ""), None),  # this GPU was not read at all
    ]
    fams = gpu_families(FIELDS, rows, {}, {}, [])
    names = {f.name for f in fams}
    assert c.DCGM_MEMORY_TEMP.name not in names  # no family rather than a fake value
    assert c.DCGM_GPU_TEMP.name in names
    assert all(s.labels["gpu"] == "3" for f in fams for s in f.samples if f.name != c.DCGM_XID_ERRORS.name)
    # an unread GPU keeps its last XID (0: none seen), which matters most when it fails
    assert values(fams, "4") == {c.DCGM_XID_ERRORS.name: 0}
    assert "Hostname" not in fams[0].samples[0].labels  # as dcgm-exporter: absent when unknown


def test_fb_used_is_nvml_used_even_when_free_is_unknown() -> None:
    reading = RawGpu(mem_total=85520809984, mem_used=10 * MIB + 5)
    v = values(gpu_families(FIELDS, [GpuRow(3, gpu_labels(H100, ""), reading)], {}, {}, []))
    assert v[c.DCGM_FB_USED.name] == 10
    assert c.DCGM_FB_FREE.name not in v


def test_xid_counts_by_code_last_xid_and_process_memory() -> None:
    labels = gpu_labels(H100, "n")
    usage = [ProcessUsage(3, "llm-0", "serving", "triton", "uid-1", "c" * 64, 5 * 2**30)]
    fams = gpu_families(
        FIELDS, [GpuRow(3, labels, H100_READING)], {(3, 79): 2, (3, 13): 1, (9, 1): 1}, {3: 79}, usage
    )
    by_name = {f.name: f for f in fams}
    xids = by_name[c.GPU_XID_ERRORS_TOTAL.name]
    assert xids.type == "counter"
    assert sorted((s.labels["xid"], s.value) for s in xids.samples) == [
        ("13", 1),
        ("79", 2),
    ]  # GPU 9 is unknown
    assert values(fams)[c.DCGM_XID_ERRORS.name] == 79
    (proc,) = by_name[c.GPU_PROCESS_MEMORY.name].samples
    assert proc.value == 5 * 2**30
    assert tuple(proc.labels) == c.GPU_PROCESS_MEMORY.labels
    assert (proc.labels["pod"], proc.labels["namespace"], proc.labels["container"]) == (
        "llm-0",
        "serving",
        "triton",
    )


def test_rendered_text_keeps_dcgm_counter_names_and_parses_back() -> None:
    labels = {**gpu_labels(H100, "node-a"), "modelName": 'odd "name" \\ with\nnewline'}
    fams = gpu_families(FIELDS, [GpuRow(3, labels, H100_READING)], {(3, 79): 1}, {}, [])
    fams += health_families("simulated", "node-a", True, {("nvmlDeviceGetPowerUsage", "3"): 4}, 0.001)
    text = render(fams).decode()
    assert (
        "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\nDCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{" in text
    )
    assert "\ninferwatch_gpu_xid_errors_total{" in text
    assert 'inferwatch_gpu_backend_errors_total{call="nvmlDeviceGetPowerUsage",gpu="3"} 4\n' in text
    parsed = parse_families(text)
    (sample,) = parsed[c.DCGM_GPU_UTIL.name].samples
    assert sample.labels["modelName"] == 'odd "name" \\ with\nnewline'
    assert sample.value == 87
    assert parsed["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].type == "counter"


def test_default_fields_file_lists_every_dcgm_metric_of_the_contract() -> None:
    assert {f.metric for f in load_fields(DEFAULT_FIELDS)} == set(c.DCGM_METRICS)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("# only a comment\n\n", "<f>: no fields listed"),
        ("DCGM_FI_DEV_GPU_UTIL, gauge\n", "<f>:1: expected 'field, type, help'"),
        (
            "# c\nDCGM_FI_DEV_GPU_UTIL, gauge, ok\nDCGM_FI_DEV_NOPE, gauge, x\n",
            "<f>:3: DCGM_FI_DEV_NOPE: not a field",
        ),
        ("DCGM_FI_DEV_GPU_UTIL, counter, x\n", "<f>:1: DCGM_FI_DEV_GPU_UTIL: type 'counter' differs"),
        (
            "DCGM_FI_DEV_GPU_UTIL, histogram, x\n",
            "<f>:1: DCGM_FI_DEV_GPU_UTIL: type must be gauge or counter",
        ),
        ("DCGM_FI_DEV_GPU_UTIL, label, Driver Version\n", "<f>:1: DCGM_FI_DEV_GPU_UTIL: label fields"),
        ("DCGM_FI_DRIVER_VERSION, gauge, Driver Version\n", "<f>:1: DCGM_FI_DRIVER_VERSION: a label"),
        ("DCGM_FI_DEV_GPU_UTIL, gauge,\n", "<f>:1: DCGM_FI_DEV_GPU_UTIL: empty help"),
        (
            "DCGM_FI_DEV_GPU_UTIL, gauge, a\n\nDCGM_FI_DEV_GPU_UTIL, gauge, b\n",
            "<f>:3: DCGM_FI_DEV_GPU_UTIL: already listed on line 1",
        ),
    ],
)
def test_fields_file_errors_name_the_line(text: str, error: str) -> None:
    with pytest.raises(FieldsError) as exc:
        parse_fields(text, "<f>")
    assert str(exc.value).startswith(error)
    assert "\n" not in str(exc.value)


def test_fields_file_keeps_help_with_commas_and_order() -> None:
    fields = parse_fields(
        "DCGM_FI_DEV_FB_USED, gauge, Used, in MiB.\n  DCGM_FI_DEV_GPU_UTIL ,gauge,   Util\n"
    )
    assert [(f.metric.name, f.help, f.line) for f in fields] == [
        ("DCGM_FI_DEV_FB_USED", "Used, in MiB.", 1),
        ("DCGM_FI_DEV_GPU_UTIL", "Util", 2),
    ]
