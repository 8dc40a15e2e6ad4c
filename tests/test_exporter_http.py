"""The GPU exporter as a user runs it: ``inferwatch gpu-exporter`` scraped over HTTP and parsed
with prometheus_client's parser."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import httpx
import pytest

from exporters.fields import load_fields
from inferwatch import contract as c
from tests.fixtures.gpu_exporter import SIM_GPUS, RunningExporter, start_gpu_exporter
from tests.fixtures.net import free_port, inferwatch_cmd

MIB = 1024 * 1024
# dcgm-exporter puts the unit in the help text; these are its spellings.
UNIT_IN_HELP = {
    "percent": "(in %)",
    "MiB": "(in MiB)",
    "MHz": "(in MHz)",
    "celsius": "(in C)",
    "watts": "(in W)",
    "millijoules": "(in mJ)",
}
GPU_LABEL_SET = set(c.GPU_LABELS)


def family_key(m: c.Metric) -> str:
    """The name prometheus_client's parser files a family under (counters lose ``_total``)."""
    return m.name[: -len("_total")] if m.type == "counter" and m.name.endswith("_total") else m.name


def exposed_names(text: str) -> set[str]:
    """Sample names exactly as written on the wire (the parser renames counters)."""
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_:][A-Za-z0-9_:]*)[{ ]", text, re.M)}


def by_gpu(fam, name: str | None = None) -> dict[str, float]:
    return {s.labels[c.L_GPU]: s.value for s in fam.samples if name is None or s.name == name}


def test_every_dcgm_field_has_dcgm_exporters_name_type_unit_and_labels(gpu_exporter: RunningExporter) -> None:
    text = gpu_exporter.scrape_text()
    fams = gpu_exporter.scrape()
    names = exposed_names(text)
    for field in load_fields():
        m = field.metric
        assert m.name in names, f"{m.name} not exposed under its exact name"
        fam = fams[family_key(m)]
        assert fam.type == m.type, m.name
        assert UNIT_IN_HELP.get(m.unit, "") in fam.documentation, (m.name, fam.documentation)
        assert len(fam.samples) == SIM_GPUS, m.name
        for s in fam.samples:
            # simulated: no driver version; no kubelet: no pod labels; the XID gauge adds its code
            extra = {c.L_ERR_CODE, c.L_ERR_MSG} if m is c.DCGM_XID_ERRORS else set()
            assert set(s.labels) == GPU_LABEL_SET | extra, (m.name, s.labels)
            assert set(s.labels) <= set(m.labels), (m.name, s.labels)
            assert s.labels[c.L_MODEL_NAME] == "NVIDIA H200"
            assert s.labels[c.L_DEVICE] == f"nvidia{s.labels[c.L_GPU]}"
            assert re.fullmatch(
                r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", s.labels[c.L_UUID]
            )
            assert s.labels[c.L_HOSTNAME]
        assert sorted(by_gpu(fam)) == [str(i) for i in range(SIM_GPUS)]


def test_inferwatch_metrics_have_contract_names_types_and_labels(gpu_exporter: RunningExporter) -> None:
    text = gpu_exporter.scrape_text()
    fams = gpu_exporter.scrape()
    for m in (c.GPU_FB_TOTAL_BYTES, c.GPU_BACKEND_INFO, c.GPU_BACKEND_UP, c.GPU_SCRAPE_DURATION):
        assert m.name in exposed_names(text), m.name
        fam = fams[family_key(m)]
        assert fam.type == m.type
        assert fam.documentation == m.help
        assert not m.unit or m.name.endswith(f"_{m.unit}"), m.name  # Prometheus naming: unit suffix
        for s in fam.samples:
            assert tuple(s.labels) == m.labels or set(s.labels) == set(m.labels), (m.name, s.labels)
    info = fams[family_key(c.GPU_BACKEND_INFO)].samples
    assert [(s.labels["backend"], s.value) for s in info] == [("simulated", 1.0)]
    assert [s.value for s in fams[family_key(c.GPU_BACKEND_UP)].samples] == [1.0]
    (dur,) = fams[family_key(c.GPU_SCRAPE_DURATION)].samples
    assert 0 < dur.value < 1
    for m in (c.GPU_BACKEND_ERRORS, c.GPU_XID_ERRORS_TOTAL, c.GPU_PROCESS_MEMORY):
        assert f"# TYPE {m.name} {m.type}" in text  # declared even while it has no samples


def test_memory_adds_up_and_values_are_in_range(gpu_exporter: RunningExporter) -> None:
    fams = gpu_exporter.scrape()
    used = by_gpu(fams[c.DCGM_FB_USED.name])
    free = by_gpu(fams[c.DCGM_FB_FREE.name])
    reserved = by_gpu(fams[c.DCGM_FB_RESERVED.name])
    total = by_gpu(fams[c.GPU_FB_TOTAL_BYTES.name])
    for gpu in used:
        assert used[gpu] + free[gpu] + reserved[gpu] == total[gpu] / MIB
        assert total[gpu] == 143771 * MIB  # an H200 as nvidia-smi reports it
        assert 0 < reserved[gpu] < used[gpu]
    for m in (c.DCGM_GPU_UTIL, c.DCGM_MEM_COPY_UTIL, c.DCGM_ENC_UTIL, c.DCGM_DEC_UTIL):
        assert all(0 <= v <= 100 for v in by_gpu(fams[m.name]).values()), m.name
    assert all(75 <= v <= 702 for v in by_gpu(fams[c.DCGM_POWER_USAGE.name]).values())
    assert all(20 <= v <= 90 for v in by_gpu(fams[c.DCGM_GPU_TEMP.name]).values())


def test_energy_counter_grows_and_values_follow_the_load(gpu_exporter: RunningExporter) -> None:
    assert gpu_exporter.simulate(load=1.0).status_code == 200
    first = gpu_exporter.scrape()
    time.sleep(0.3)
    busy = gpu_exporter.scrape()
    key = family_key(c.DCGM_TOTAL_ENERGY)
    e0, e1 = by_gpu(first[key]), by_gpu(busy[key])
    assert all(e1[g] > e0[g] for g in e0), "energy must grow while the GPU draws power"
    assert all(v >= 97 for v in by_gpu(busy[c.DCGM_GPU_UTIL.name]).values())
    assert all(v > 600 for v in by_gpu(busy[c.DCGM_POWER_USAGE.name]).values())

    assert gpu_exporter.simulate(load=0.0, gpus=[1]).status_code == 200
    idle = gpu_exporter.scrape()
    util = by_gpu(idle[c.DCGM_GPU_UTIL.name])
    assert util["1"] == 0 and util["0"] >= 97
    assert by_gpu(idle[c.DCGM_SM_CLOCK.name])["1"] < by_gpu(idle[c.DCGM_SM_CLOCK.name])["0"]
    assert by_gpu(idle[c.DCGM_POWER_USAGE.name])["1"] < 100


def test_simulate_forces_memory_pressure_on_the_named_gpus_and_clears(gpu_exporter: RunningExporter) -> None:
    resp = gpu_exporter.simulate(fb_used_ratio=0.95, gpus=[0])
    assert resp.status_code == 200
    assert resp.json()["gpus"][0]["fb_used_ratio"] == 0.95
    fams = gpu_exporter.scrape()
    used = by_gpu(fams[c.DCGM_FB_USED.name])
    total = {g: v / MIB for g, v in by_gpu(fams[c.GPU_FB_TOTAL_BYTES.name]).items()}
    assert used["0"] / total["0"] == pytest.approx(0.95, abs=0.001)
    assert used["1"] / total["1"] < 0.6  # untouched: follows the load

    assert gpu_exporter.simulate(fb_used_ratio=None).status_code == 200
    used = by_gpu(gpu_exporter.scrape()[c.DCGM_FB_USED.name])
    assert used["0"] / total["0"] < 0.6


def test_simulated_xid_is_counted_by_code_and_sets_the_last_xid_gauge(gpu_exporter: RunningExporter) -> None:
    def count() -> float:
        fam = gpu_exporter.scrape().get(family_key(c.GPU_XID_ERRORS_TOTAL))
        return (
            sum(s.value for s in fam.samples if (s.labels["gpu"], s.labels["xid"]) == ("1", "79"))
            if fam
            else 0
        )

    before = count()
    assert gpu_exporter.simulate(xid=79, gpus=[1]).status_code == 200
    assert gpu_exporter.simulate(xid=79, gpus=[1]).status_code == 200
    assert count() == before + 2
    last = by_gpu(gpu_exporter.scrape()[c.DCGM_XID_ERRORS.name])
    assert last["1"] == 79


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "not valid JSON"),
        (b"[0.9]", "JSON object"),
        (b"{}", "nothing to simulate"),
        (b'{"fb_used_ratio": 1.5}', "from 0 to 1"),
        (b'{"fb_used_ratio": -0.1}', "from 0 to 1"),
        (b'{"fb_used_ratio": "0.9"}', "number"),
        (b'{"fb_used_ratio": true}', "number"),
        (b'{"load": 2}', "from 0 to 1"),
        (b'{"load": 0.5, "gpus": [7]}', "not a GPU index"),
        (b'{"load": 0.5, "gpus": []}', "non-empty list"),
        (b'{"load": 0.5, "gpus": "0"}', "non-empty list"),
        (b'{"xid": -1}', "positive integer"),
        (b'{"fb_used_ratio": 0.9, "colour": "red"}', "unknown field"),
    ],
)
def test_simulate_refuses_bad_input_with_400_and_changes_nothing(
    gpu_exporter: RunningExporter, body: bytes, reason: str
) -> None:
    assert gpu_exporter.simulate(fb_used_ratio=0.5, gpus=[1]).status_code == 200
    resp = httpx.post(f"{gpu_exporter.url}/simulate", content=body, timeout=10)
    assert resp.status_code == 400
    assert reason in resp.json()["error"]
    state = httpx.get(f"{gpu_exporter.url}/simulate", timeout=10).json()["gpus"]
    assert [g["fb_used_ratio"] for g in state] == [None, 0.5]
    assert [g["load"] for g in state] == [None, None]


def test_unknown_routes_and_methods(gpu_exporter: RunningExporter) -> None:
    assert httpx.get(f"{gpu_exporter.url}/nope", timeout=10).status_code == 404
    resp = httpx.post(gpu_exporter.metrics_url, content=b"x", timeout=10)
    assert resp.status_code == 405 and "GET" in resp.headers["allow"]
    health = httpx.get(f"{gpu_exporter.url}/healthz", timeout=10)
    assert health.status_code == 200
    body = health.json()
    assert body.pop("host_pid_namespace") in (True, False, None)  # depends on where tests run
    assert body == {
        "status": "ok",
        "backend": "simulated",
        "backend_up": True,
        "gpus": 2,
        "gpus_down": [],
        "driver_version": "",
        "error": None,
    }


def _nvml_initializes_here() -> bool:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_backend_nvml_serves_and_reports_whether_nvml_is_up(tmp_path) -> None:
    """With --backend nvml the exporter stays up whatever NVML does, and its up metric says
    what this host's NVML does (down on the development machines, which have no GPU)."""
    nvml_ok = _nvml_initializes_here()
    with start_gpu_exporter(tmp_path, "--backend", "nvml", "--nvml-retry-max", "1") as exp:
        health = httpx.get(f"{exp.url}/healthz", timeout=10).json()
        assert health["backend"] == "nvml" and health["backend_up"] is nvml_ok
        time.sleep(2.5)  # retries at 1 s, then every 1 s (--nvml-retry-max)
        fams = exp.scrape()
        up = fams[c.GPU_BACKEND_UP.name].samples
        assert [(s.labels, s.value) for s in up] == [({"backend": "nvml"}, 1.0 if nvml_ok else 0.0)]
        assert httpx.post(f"{exp.url}/simulate", json={"load": 1}, timeout=10).status_code == 404
        if not nvml_ok:
            errors = fams[family_key(c.GPU_BACKEND_ERRORS)].samples
            inits = [s.value for s in errors if s.labels == {"call": "nvmlInit", "gpu": ""}]
            assert inits and inits[0] >= 3, "the first attempt and at least two retries are counted"
            assert c.DCGM_GPU_UTIL.name not in fams
            assert health["error"].startswith("NVMLError")


def test_backend_auto_falls_back_to_simulated_loudly(tmp_path) -> None:
    nvml_ok = _nvml_initializes_here()
    with start_gpu_exporter(tmp_path, "--backend", "auto", "--gpus", "3") as exp:
        info = exp.scrape()[c.GPU_BACKEND_INFO.name].samples
        assert [s.labels["backend"] for s in info] == ["nvml" if nvml_ok else "simulated"]
        if not nvml_ok:
            assert len(exp.scrape()[c.DCGM_GPU_UTIL.name].samples) == 3
            logs = [
                json.loads(line) for line in exp.log_path.read_text().splitlines() if line.startswith("{")
            ]
            assert any(e["level"] == "warning" and "SIMULATED" in e["msg"] for e in logs)


def test_sigterm_stops_cleanly_with_structured_logs(tmp_path) -> None:
    with start_gpu_exporter(tmp_path, "--backend", "simulated") as exp:
        exp.scrape()
        exp.proc.send_signal(signal.SIGTERM)
        assert exp.proc.wait(10) == 0
    lines = exp.log_path.read_text().splitlines()
    entries = [json.loads(line) for line in lines]  # every line is one JSON object
    assert [e["msg"] for e in entries][-2:] == ["stopping", "stopped"]
    assert entries[-2]["signal"] == "SIGTERM"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "0"], "--gpus must be 1..1024"),
        (["--gpu-model", "Z9"], "--gpu-model 'Z9' is unknown"),
        (["--scrape-timeout", "0"], "--scrape-timeout must be above 0"),
        (["--port", "70000"], "--port must be 0..65535"),
        (["--fields", "/nonexistent.csv"], "/nonexistent.csv: cannot read"),
    ],
)
def test_bad_options_fail_with_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run(
        inferwatch_cmd("gpu-exporter", "--backend", "simulated", "--port", str(free_port()), *args),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("inferwatch: error: ") and message in proc.stderr
    assert proc.stderr.count("\n") == 1


def test_port_in_use_fails_with_one_line(gpu_exporter: RunningExporter) -> None:
    proc = subprocess.run(
        inferwatch_cmd(
            "gpu-exporter", "--backend", "simulated", "--host", "127.0.0.1", "--port", str(gpu_exporter.port)
        ),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1].startswith(
        f"inferwatch: error: cannot listen on 127.0.0.1:{gpu_exporter.port}"
    )


def test_fields_option_collects_only_the_listed_fields(tmp_path) -> None:
    fields = tmp_path / "counters.csv"
    fields.write_text(
        f"# trimmed\n{c.DCGM_FB_USED.name}, gauge, Used (in MiB).\n"
        f"{c.DCGM_GPU_UTIL.name}, gauge, Util (in %).\n"
    )
    with start_gpu_exporter(tmp_path, "--backend", "simulated", "--fields", str(fields)) as exp:
        fams = exp.scrape()
    dcgm = sorted(name for name in fams if name.startswith("DCGM_"))
    assert dcgm == sorted([c.DCGM_FB_USED.name, c.DCGM_GPU_UTIL.name])
    assert fams[c.DCGM_FB_USED.name].documentation == "Used (in MiB)."
    assert c.GPU_FB_TOTAL_BYTES.name in fams  # inferwatch's own metrics are not in the fields file


def test_a_malformed_fields_file_is_refused_naming_its_line(tmp_path) -> None:
    fields = tmp_path / "counters.csv"
    fields.write_text(f"{c.DCGM_FB_USED.name}, gauge, ok\n\n{c.DCGM_GPU_UTIL.name}, counter, wrong type\n")
    proc = subprocess.run(
        inferwatch_cmd(
            "gpu-exporter", "--backend", "simulated", "--port", str(free_port()), "--fields", str(fields)
        ),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stderr == (
        f"inferwatch: error: {fields}:3: {c.DCGM_GPU_UTIL.name}: "
        "type 'counter' differs from dcgm-exporter's 'gauge'\n"
    )
