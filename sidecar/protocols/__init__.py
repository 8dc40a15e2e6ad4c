"""One module per wire protocol: ``http1`` (HTTP/1.1, with the ``sidecar.apis`` body classifiers
and SSE observers plugged in) and the two gRPC engines, ``grpc_relay`` (HTTP/2 frames, the
default) and ``grpc_aio`` (grpc.aio), with their method table, wire reader and HTTP/2 helpers.

Each does the same four steps: classify the request, ``admission.acquire(model)``, forward,
observe (through ``sidecar.core``); each has one error boundary counting its own failure as a
server error.
"""
