#!/usr/bin/env bash
# The real-GPU check in one command, for a machine with an NVIDIA GPU and driver:
#   exporters/device_check.sh            # output under $OUT if set (the device machine), else benchmarks/device-out
# Runs `python -m exporters.gpu_check --load` (it starts the exporter with --backend nvml, holds
# 256 MiB per GPU from a libcuda process, compares labels, fields, energy, processes and owners
# with nvidia-smi) and keeps what to paste into benchmarks/RESULTS.md: nvidia-smi.txt,
# gpu_check.txt (the table), gpu_check.json (the rows), exporter.log. Exit code: gpu_check's.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/device-out}
mkdir -p "$out"
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
if ! "$py" -c "import prometheus_client, pynvml" 2>/dev/null; then
  echo "device_check: error: $py lacks prometheus_client or nvidia-ml-py (install them, or set PYTHON)" >&2
  exit 2
fi
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "kernel $(uname -r); python $("$py" -c 'import sys; print(sys.version.split()[0])'); commit $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,driver_version,memory.total --format=csv
  nvidia-smi
} >"$out/nvidia-smi.txt" 2>&1
export PYTHONUNBUFFERED=1
"$py" -m exporters.gpu_check --load --json "$out/gpu_check.json" --exporter-log "$out/exporter.log" 2>&1 \
  | tee "$out/gpu_check.txt"
rc=${PIPESTATUS[0]}
echo "gpu_check exit code: $rc" | tee -a "$out/gpu_check.txt"
exit "$rc"
