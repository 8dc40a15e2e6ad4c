"""Defaults shared by the reference server's commands, importable without numpy or FastAPI."""

from inferwatch.contract import PORTS

# The naive baseline server's port: not part of the stack's port map, and clear of it (8020 is
# the LLM sidecar's).
NAIVE_SERVER_PORT = 8030

# How long the Triton launcher waits for every reference model to be ready.
TRITON_READY_TIMEOUT = 180.0

# inferwatch load: KServe v2 tensors (http, grpc) and token streams (openai, triton-generate).
KSERVE_PROTOCOLS = ("http", "grpc")
STREAM_PROTOCOLS = ("openai", "triton-generate")
LOAD_PROTOCOLS = (*KSERVE_PROTOCOLS, *STREAM_PROTOCOLS)

# The LLM reference server's port (inferwatch vllm).
VLLM_PORT = PORTS["vllm"]
