"""Traces across real parts: with Triton's OpenTelemetry tracing on (exporting OTLP/HTTP to a
receiver in this test), the span Triton makes for an inference through the sidecar is a child of
the sidecar's server span, in the client's trace; and a real Prometheus stores the trace id as
an exemplar of the sidecar's latency histogram."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from reference_server.launcher import TritonServer
from tests.fixtures.net import free_port
from tests.fixtures.sidecar import launch_sidecar

pytestmark = pytest.mark.integration

BODY = {"inputs": [{"name": "FEATURES", "shape": [1, 16, 32], "datatype": "FP32", "data": [0.5] * 512}]}


class OtlpReceiver:
    """Collects the spans an OTLP/HTTP exporter posts (Triton's exporter sends JSON)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                for rs in json.loads(body).get("resourceSpans", []):
                    for ss in rs.get("scopeSpans", []):
                        receiver.spans.extend(ss.get("spans", []))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def traced_triton(tmp_path: Path) -> Iterator[tuple[TritonServer, OtlpReceiver]]:
    receiver = OtlpReceiver()
    args = (
        "--model-control-mode=explicit",
        "--load-model=ranker",
        *(
            "--trace-config",
            "mode=opentelemetry",
            "--trace-config",
            "rate=1",
            "--trace-config",
            "level=TIMESTAMPS",
        ),
        *("--trace-config", f"opentelemetry,url={receiver.url}"),
        *("--trace-config", "opentelemetry,bsp_schedule_delay=100"),
    )
    server = TritonServer(
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        state_dir_path=tmp_path / "triton",
        extra_args=args,
    ).start()
    try:
        yield server, receiver
    finally:
        server.stop()
        receiver.server.shutdown()


def test_triton_span_is_a_child_of_the_sidecar_span(traced_triton, tmp_path: Path) -> None:
    triton, receiver = traced_triton
    trace_id, client_span = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with launch_sidecar(
        triton.http_url, triton.grpc_url, tmp_path, "--trace-sample-ratio", "1", "--grpc-port", "0", env=env
    ) as sc:
        r = httpx.post(
            f"{sc.base_url}/v2/models/ranker/versions/1/infer",
            json=BODY,
            headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
        )
        assert r.status_code == 200
        deadline = time.monotonic() + 15
        ours: list[dict] = []
        theirs: list[dict] = []
        while time.monotonic() < deadline and not (ours and theirs):
            ours = [
                json.loads(line)
                for line in sc.log().splitlines()
                if line.startswith("{") and '"context"' in line and trace_id in line
            ]
            theirs = [
                s for s in receiver.spans if s.get("traceId") == trace_id and s.get("name") == "InferRequest"
            ]
            time.sleep(0.2)
    assert len(ours) == 1 and len(theirs) == 1, (ours, receiver.spans)
    sidecar_span = ours[0]
    assert sidecar_span["parent_id"] == "0x" + client_span
    # Triton's request span hangs under the sidecar's span, not under the client's.
    assert theirs[0]["parentSpanId"] == sidecar_span["context"]["span_id"].removeprefix("0x")


def test_prometheus_stores_the_exemplars(triton, tmp_path: Path, processes) -> None:
    """A real Prometheus (exemplar storage on) scraping the sidecar keeps the trace id of a
    sampled request on the latency histogram, so a dashboard can jump from a slow bucket to
    its trace."""
    from inferwatch import contract
    from tests.fixtures.net import wait_http

    trace_id = "6bf92f3577b34da6a3ce929d0e0e4738"
    with launch_sidecar(
        triton.http_url,
        triton.grpc_url,
        tmp_path,
        "--trace-sample-ratio",
        "1",
        "--grpc-port",
        "0",
        env={"OTEL_TRACES_EXPORTER": "none"},
    ) as sc:
        r = httpx.post(
            f"{sc.base_url}/v2/models/ranker/versions/1/infer",
            json=BODY,
            headers={"traceparent": f"00-{trace_id}-20f067aa0ba902b9-01"},
        )
        assert r.status_code == 200
        port = free_port()
        target = sc.metrics_url.removeprefix("http://").removesuffix("/metrics")
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s}\n"
            f"scrape_configs:\n  - job_name: {contract.JOB_SIDECAR}\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
        proc = processes.start(
            "prometheus",
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--enable-feature=exemplar-storage",
            ],
        )
        wait_http(f"http://127.0.0.1:{port}/-/ready", timeout=60, proc=proc)
        query = f'{contract.REQUEST_DURATION.name}_bucket{{model="ranker"}}'
        deadline = time.monotonic() + 30
        found: list[dict] = []
        while time.monotonic() < deadline and not found:
            now = time.time()
            data = httpx.get(
                f"http://127.0.0.1:{port}/api/v1/query_exemplars",
                params={"query": query, "start": now - 300, "end": now + 60},
                timeout=5,
            ).json()["data"]
            found = [
                e for series in data for e in series["exemplars"] if e["labels"].get("trace_id") == trace_id
            ]
            time.sleep(0.5)
    assert found, "Prometheus stored no exemplar with the request's trace id"
