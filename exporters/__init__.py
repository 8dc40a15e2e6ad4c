"""GPU exporter: NVML (nvidia-ml-py) or simulated GPUs under dcgm-exporter's metric names."""
