"""What every protocol shares: model catalog, upstream health, admission and overload answers,
telemetry (metrics and spans) and stream (TTFT/TPOT/token) recording.

Imports point one way: ``sidecar.protocols`` imports from here and from ``sidecar.apis``;
nothing here imports a protocol.
"""
