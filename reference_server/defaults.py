"""Defaults shared by the reference server's commands, importable without numpy or FastAPI."""

# The naive baseline server's port (not part of the stack's port map in DESIGN.md).
NAIVE_SERVER_PORT = 8020

# How long the Triton launcher waits for every reference model to be ready.
TRITON_READY_TIMEOUT = 180.0

# inferwatch load: KServe v2 tensors (http, grpc) and token streams (openai, triton-generate).
KSERVE_PROTOCOLS = ("http", "grpc")
STREAM_PROTOCOLS = ("openai", "triton-generate")
LOAD_PROTOCOLS = (*KSERVE_PROTOCOLS, *STREAM_PROTOCOLS)

# The LLM reference server's port (inferwatch vllm; llm/vllm_server.py DEFAULT_PORT, tested).
VLLM_PORT = 8100
