"""deploy/pin-images.py: it finds every pulled image (compose, the Dockerfile, the
manifests, the overlays' `images:` entries), writes the digest beside the tag, keeps the
files otherwise byte for byte, and says plainly what it could not resolve. The public
registries are out of reach here: the rewriting is tested with a table of digests; the
registry protocol against a real registry on loopback (Debian's docker-registry, CNCF
Distribution 2.8, holding a pushed two-platform index); and the bearer-token challenge,
which that registry serves only with a token server of its own, against a small loopback
server that answers the way the distribution spec says."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from inferwatch.net import free_port
from tests.fixtures.deploy import ROOT, kubectl, load_all

spec = importlib.util.spec_from_file_location("deploy_pin_images", ROOT / "deploy" / "pin-images.py")
pin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pin)

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "docker-compose.yml", tmp_path)
    shutil.copytree(ROOT / "deploy" / "docker", tmp_path / "deploy" / "docker")
    shutil.copytree(ROOT / "deploy" / "kubernetes", tmp_path / "deploy" / "kubernetes")
    return tmp_path


def table(name: str, tag: str) -> str:
    if name.startswith("nvcr.io/"):
        raise pin.PinError(f"{name}:{tag}: cannot reach nvcr.io")
    return B


def test_every_pulled_image_gets_its_digest_beside_its_tag(tree: Path, capsys) -> None:
    before = {p: p.read_text() for p in pin.files(tree)}
    assert pin.main([], resolve=table, root=tree) == 1  # Triton's could not be resolved
    out = capsys.readouterr().out
    assert "cannot pin: nvcr.io/nvidia/tritonserver:24.10-py3" in out
    compose = (tree / "docker-compose.yml").read_text()
    for image in (
        "prom/prometheus:v3.5.0",
        "prom/alertmanager:v0.28.1",
        "grafana/grafana:12.1.1",
        "vllm/vllm-openai:v0.32.0",
    ):
        assert f"image: {image}@{B}\n" in compose
    assert "image: nvcr.io/nvidia/tritonserver:24.10-py3\n" in compose  # unchanged, not invented
    assert "image: inferwatch:0.1.0\n" in compose  # built locally, never pulled
    assert f"FROM python:3.11.14-slim-bookworm@{B}\n" in (tree / "deploy/docker/Dockerfile").read_text()
    # Only the image lines changed.
    for path, old in before.items():
        new = path.read_text()
        changed = [(a, b) for a, b in zip(old.splitlines(), new.splitlines(), strict=False) if a != b]
        assert all("@" + B in b or b.strip() == f"digest: {B}" for _, b in changed), path
    # The overlays' inferwatch entries gain `digest:`, and kustomize writes tag@digest.
    overlay = tree / "deploy/kubernetes/overlays/example"
    proc = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    images = {
        c["image"]
        for d in load_all(proc.stdout)
        if d["kind"] in ("Deployment", "DaemonSet")
        for c in [
            *d["spec"]["template"]["spec"].get("initContainers", []),
            *d["spec"]["template"]["spec"]["containers"],
        ]
    }
    assert images == {
        f"registry.example.com/inferwatch:0.1.0@{B}",
        "nvcr.io/nvidia/tritonserver:24.10-py3",
        f"vllm/vllm-openai:v0.32.0@{B}",  # the example vLLM, resolved like the others
    }


def test_check_reports_stale_digests_and_changes_nothing(tree: Path, capsys) -> None:
    pin.main([], resolve=lambda n, t: A, root=tree)
    snapshot = {p: p.read_text() for p in pin.files(tree)}
    capsys.readouterr()
    assert pin.main(["--check"], resolve=lambda n, t: A, root=tree) == 0
    assert pin.main(["--check"], resolve=lambda n, t: B, root=tree) == 1
    assert f"prom/prometheus:v3.5.0 -> {B}" in capsys.readouterr().out
    assert snapshot == {p: p.read_text() for p in pin.files(tree)}
    # A second run replaces the digest in place instead of adding another.
    pin.main([], resolve=lambda n, t: B, root=tree)
    kust = (tree / "deploy/kubernetes/overlays/example/models/kustomization.yaml").read_text()
    assert kust.count("digest:") == 1 and B in kust


def test_image_limits_the_run_to_the_named_reference(tree: Path) -> None:
    assert (
        pin.main(["--image", "registry.example.com/inferwatch:0.1.0"], resolve=lambda n, t: B, root=tree) == 0
    )
    assert B not in (tree / "docker-compose.yml").read_text()  # the other images are left alone
    assert (
        f"digest: {B}"
        in (tree / "deploy/kubernetes/overlays/example-hpa/models/kustomization.yaml").read_text()
    )


def test_the_committed_files_carry_the_digests_recorded_in_the_readme() -> None:
    readme = (ROOT / "deploy" / "README.md").read_text()
    pinned = {}
    for path in pin.files(ROOT):
        for line in path.read_text().splitlines():
            if (m := pin.LINE.match(line)) and (ref := pin.REF.fullmatch(m["ref"])) and ref["digest"]:
                pinned[f"{ref['name']}:{ref['tag']}"] = ref["digest"]
    assert set(pinned) >= {
        "prom/prometheus:v3.5.0",
        "prom/alertmanager:v0.28.1",
        "grafana/grafana:12.1.1",
        "python:3.11.14-slim-bookworm",
    }
    for ref, digest in pinned.items():
        assert f"`{ref}`" in readme and digest in readme, ref
    # What is not pinned is named in the README as not established.
    if "nvcr.io/nvidia/tritonserver:24.10-py3" not in pinned:
        assert "**Not established:** `nvcr.io/nvidia/tritonserver:24.10-py3`" in readme
    if "vllm/vllm-openai:v0.32.0" not in pinned:
        assert (
            "**Not established:** `nvcr.io/nvidia/tritonserver:24.10-py3` and `vllm/vllm-openai:v0.32.0`"
            in (" ".join(readme.split()))
        )


@pytest.mark.parametrize(
    ("name", "host", "repo"),
    [
        ("python", "registry-1.docker.io", "library/python"),
        ("prom/prometheus", "registry-1.docker.io", "prom/prometheus"),
        ("nvcr.io/nvidia/tritonserver", "nvcr.io", "nvidia/tritonserver"),
        ("localhost:5000/x", "localhost:5000", "x"),
    ],
)
def test_names_resolve_to_registry_and_repository(name: str, host: str, repo: str) -> None:
    assert pin.split_name(name) == (host, repo)


class _Registry(BaseHTTPRequestHandler):
    """Answers as the distribution spec says: 401 with a Bearer challenge, a token from
    the realm, then the manifest's digest in Docker-Content-Digest."""

    seen: list[tuple[str, str, str]] = []

    def _reply(self, code: int, headers: dict[str, str], body: bytes = b"") -> None:
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        host = f"http://127.0.0.1:{self.server.server_address[1]}"
        if self.path.startswith("/token?"):
            self.seen.append(("token", self.path, ""))
            self._reply(200, {"Content-Type": "application/json"}, b'{"token": "t0k"}')
        elif self.headers.get("Authorization") != "Bearer t0k":
            challenge = f'Bearer realm="{host}/token",service="test",scope="repository:library/python:pull"'
            self._reply(401, {"WWW-Authenticate": challenge})
        else:
            self.seen.append((self.command, self.path, self.headers.get("Accept", "")))
            self._reply(200, {"Docker-Content-Digest": A})

    do_HEAD = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_registry_protocol_with_the_token_challenge(monkeypatch: pytest.MonkeyPatch) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        monkeypatch.setattr(pin, "split_name", lambda name: (f"127.0.0.1:{port}", "library/python"))
        assert pin.registry_digest("python", "3.11.14-slim-bookworm", scheme="http") == A
        (token, (method, path, accept)) = _Registry.seen[-2:]
        assert "scope=repository%3Alibrary%2Fpython%3Apull" in token[1]
        assert (method, path) == ("HEAD", "/v2/library/python/manifests/3.11.14-slim-bookworm")
        assert accept.startswith("application/vnd.oci.image.index.v1+json")
        monkeypatch.setattr(pin, "split_name", lambda name: ("127.0.0.1:1", "x"))
        with pytest.raises(pin.PinError, match="cannot reach"):
            pin.registry_digest("x", "1", scheme="http")
    finally:
        server.shutdown()
        server.server_close()


# ---------------------------------------------------------------------------------------
# Against a real registry: Debian's docker-registry (CNCF Distribution 2.8) on loopback
# ---------------------------------------------------------------------------------------
def _push(base: str, repo: str, tag: str, archs: tuple[str, ...] = ("amd64", "arm64")) -> str:
    """Pushes an OCI image index (tiny, layer-less images, one per arch); returns its digest."""

    def blob(data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        start = httpx.post(f"{base}/v2/{repo}/blobs/uploads/")
        assert start.status_code == 202, start.text
        location = httpx.URL(base).join(start.headers["Location"])
        done = httpx.put(
            location.copy_merge_params({"digest": digest}),
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert done.status_code == 201, done.text
        return {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest, "size": len(data)}

    def manifest(ref: str | None, body: dict, media_type: str) -> dict:
        data = json.dumps(body).encode()
        ref = ref or "sha256:" + hashlib.sha256(data).hexdigest()  # by its own digest
        put = httpx.put(
            f"{base}/v2/{repo}/manifests/{ref}", content=data, headers={"Content-Type": media_type}
        )
        assert put.status_code == 201, put.text
        return {"mediaType": media_type, "digest": put.headers["Docker-Content-Digest"], "size": len(data)}

    image = "application/vnd.oci.image.manifest.v1+json"
    entries = []
    for arch in archs:
        config = blob(
            json.dumps(
                {"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}
            ).encode()
        )
        m = manifest(None, {"schemaVersion": 2, "mediaType": image, "config": config, "layers": []}, image)
        entries.append({**m, "platform": {"architecture": arch, "os": "linux"}})
    index = "application/vnd.oci.image.index.v1+json"
    return manifest(tag, {"schemaVersion": 2, "mediaType": index, "manifests": entries}, index)["digest"]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> str:
    exe = shutil.which("docker-registry")
    assert exe, "docker-registry (Debian's CNCF Distribution) is missing: run scripts/bootstrap"
    folder = tmp_path_factory.mktemp("registry")
    port = free_port()
    (folder / "config.yml").write_text(
        f"version: 0.1\nlog: {{level: warn}}\nstorage: {{filesystem: {{rootdirectory: {folder / 'data'}}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}'}}\n"
    )
    proc = subprocess.Popen(
        [exe, "serve", str(folder / "config.yml")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(f"{base}/v2/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_index_digest_from_a_real_registry(registry: str, tree: Path) -> None:
    digest = _push(f"http://{registry}", "inferwatch", "0.1.0")
    assert pin.registry_digest(f"{registry}/inferwatch", "0.1.0") == digest  # the index's, not a platform's
    with pytest.raises(pin.PinError, match="HTTP 404"):
        pin.registry_digest(f"{registry}/inferwatch", "9.9.9")
    # End to end: the overlays point at that registry, and one run pins them.
    for kust in (tree / "deploy/kubernetes/overlays").rglob("kustomization.yaml"):
        kust.write_text(kust.read_text().replace("registry.example.com", registry))
    assert pin.main(["--image", f"{registry}/inferwatch:0.1.0"], root=tree) == 0
    overlay = tree / "deploy/kubernetes/overlays/example-hpa"
    proc = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"image: {registry}/inferwatch:0.1.0@{digest}" in proc.stdout
    assert pin.main(["--check", "--image", f"{registry}/inferwatch:0.1.0"], root=tree) == 0
    # Re-pushed under the same tag: --check notices, and a run moves the pin.
    newer = _push(f"http://{registry}", "inferwatch", "0.1.0", archs=("amd64",))
    assert newer != digest
    assert pin.main(["--check", "--image", f"{registry}/inferwatch:0.1.0"], root=tree) == 1
    assert pin.main(["--image", f"{registry}/inferwatch:0.1.0"], root=tree) == 0
    kust = (overlay / "models" / "kustomization.yaml").read_text()
    assert f"digest: {newer}" in kust and digest not in kust
