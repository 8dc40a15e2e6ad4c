"""Defaults shared by the reference server's commands, importable without numpy or FastAPI."""

# The naive baseline server's port (not part of the stack's port map in DESIGN.md).
NAIVE_SERVER_PORT = 8020

# How long the Triton launcher waits for every reference model to be ready.
TRITON_READY_TIMEOUT = 180.0
