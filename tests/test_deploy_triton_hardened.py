"""The example Triton Deployment's hardening, run for real: the Triton these tests use
(2.51, the nvidia-pytriton wheel's) serves every reference model as the manifest's
non-root user, with no capability and no supplementary group, on a root filesystem where
every mount is read-only, writing only to fresh tmpfs at the manifest's emptyDir paths
(/tmp and /dev/shm). It runs in a private mount namespace (`unshare -m`, as root, which
CI is), so nothing outside the test changes. NGC's image has the same binary and backends
in another place; no container runtime runs here to start that image itself."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from inferwatch.net import free_port
from reference_server.launcher import TritonServer, find_binary, prepare_backends, triton_env
from tests.fixtures.deploy import K8S, kustomize_build


def _triton(docs: list[dict]) -> tuple[dict, dict]:
    (d,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "triton"]
    spec = d["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return spec, c


def _closed_ancestor(path: Path) -> Path | None:
    """The highest ancestor of ``path`` that other users cannot traverse (here: /root, 0700,
    where this interpreter lives), or None. A container image has no such thing."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not stat.S_IMODE(parent.stat().st_mode) & stat.S_IXOTH:
            return parent
    return None


ROOT = Path(__file__).resolve().parents[1]


def keep_visible(path: Path, writable: list[str], keep: Path) -> tuple[list[str], list[str]]:
    """Shell steps that keep ``path`` (the checkout, which may itself live under /tmp) readable
    once fresh tmpfs cover the writable mount points: bind it aside before, bind it back
    read-only after. Nothing when ``path`` is under none of them."""
    if not any(path == Path(w) or Path(w) in path.parents for w in writable):
        return [], []
    keep.mkdir()
    before = [f"mount --bind {path} {keep}"]
    after = [f"mkdir -p {path}", f"mount --bind {keep} {path}", f"mount -o remount,bind,ro {path}"]
    return before, after


@pytest.fixture()
def outside_tmp() -> Path:
    """A folder the tmpfs on /tmp does not hide and any user can traverse."""
    path = Path(tempfile.mkdtemp(prefix="inferwatch-hardened-", dir="/var/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_triton_serves_the_reference_models_as_the_manifest_says(outside_tmp: Path) -> None:
    assert os.geteuid() == 0 and shutil.which("unshare"), (
        "needs root and unshare (every inferwatch machine has both)"
    )
    tmp_path = outside_tmp
    spec, container = _triton(kustomize_build(K8S / "examples" / "triton"))
    psc, sc = spec["securityContext"], container["securityContext"]
    uid = sc.get("runAsUser", psc["runAsUser"])
    gid = sc.get("runAsGroup", psc["runAsGroup"])
    assert uid != 0 and sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = [m["mountPath"] for m in container["volumeMounts"] if "emptyDir" in volumes[m["name"]]]
    assert sorted(writable) == ["/dev/shm", "/tmp"]
    home = {e["name"]: e["value"] for e in container.get("env", [])}["HOME"]
    assert home in writable

    ports = [free_port() for _ in range(3)]
    server = TritonServer(http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2])
    binary = find_binary(None)
    # Everything Triton reads is prepared beforehand, then made read-only with the rest.
    backends = prepare_backends(binary, tmp_path / "backends")
    steps = ["mount --make-rprivate /"]
    closed = _closed_ancestor(Path(sys.base_prefix))
    if closed:
        inner = Path(sys.base_prefix).relative_to(closed).parts[0]
        keep = tmp_path / "keep"
        keep.mkdir()
        steps += [
            f"mount --bind {closed / inner} {keep}",
            f"mount -t tmpfs -o mode=755 tmpfs {closed}",
            f"mkdir {closed / inner}",
            f"mount --bind {keep} {closed / inner}",
        ]
    # A checkout under /tmp (CI may clone anywhere) would vanish under the tmpfs below.
    before, after = keep_visible(ROOT, writable, tmp_path / "checkout")
    steps += [
        *before,
        "for m in $(awk '{print $2}' /proc/self/mounts | sort -u); do"
        ' mount -o remount,bind,ro "$m" 2>/dev/null || true; done',
        *[f"mount -t tmpfs -o size=512m tmpfs {path}" for path in writable],
        *after,
        "if touch /probe-rw 2>/dev/null; then echo ROOT-WRITABLE; exit 99; fi",
        f"exec setpriv --reuid {uid} --regid {gid} --clear-groups --inh-caps=-all --bounding-set=-all -- "
        + " ".join(shlex.quote(c) for c in server.command(binary, backends)),
    ]
    env = {**triton_env(), "HOME": home}
    log = tmp_path / "triton.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", " && ".join(steps)], env=env, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 180
        ready = False
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            try:
                ready = (
                    httpx.get(f"http://127.0.0.1:{ports[0]}/v2/health/ready", timeout=2).status_code == 200
                )
            except httpx.HTTPError:
                pass
            time.sleep(0 if ready else 0.5)
        assert ready, f"Triton exited {proc.poll()}:\n{log.read_text()[-3000:]}"
        index = httpx.post(f"http://127.0.0.1:{ports[0]}/v2/repository/index", json={}, timeout=10).json()
        assert index and {m["state"] for m in index} == {"READY"}, index
        status = Path(f"/proc/{proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines())
        assert fields["Uid"].split()[0] == str(uid) and fields["Gid"].split()[0] == str(gid)
        assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
        assert fields["Groups"].strip() == ""
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    assert not Path("/probe-rw").exists()
