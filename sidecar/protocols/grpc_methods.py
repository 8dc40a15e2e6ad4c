"""What both gRPC engines know about the service they proxy: the method table, span names, the
status codes and how Triton's in-stream errors map to them.

``sidecar.protocols.grpc_relay`` (the HTTP/2 relay) and ``sidecar.protocols.grpc_aio``
(grpc.aio) import from here; nothing here imports either engine.
"""

from __future__ import annotations

from sidecar.core.telemetry import GRPC_CODES

SERVICE = "inference.GRPCInferenceService"

# Server-level methods: their messages name no model.
_SERVER_METHODS = (
    "ServerLive",
    "ServerReady",
    "ServerMetadata",
    "RepositoryIndex",
    "LogSettings",
    *(
        f"{memory}SharedMemory{op}"
        for memory in ("System", "Cuda")
        for op in ("Status", "Register", "Unregister")
    ),
)
# Method -> (model-name field, version field) of its request message, from the KServe v2 /
# Triton grpc_service.proto; 0 means the message has no such field (server-level methods).
UNARY_METHODS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(_SERVER_METHODS, (0, 0)),
    "ModelReady": (1, 2),
    "ModelMetadata": (1, 2),
    "ModelInfer": (1, 2),
    "ModelConfig": (1, 2),
    "ModelStatistics": (1, 2),
    "RepositoryModelLoad": (2, 0),  # repository_name = 1, model_name = 2
    "RepositoryModelUnload": (2, 0),
    "TraceSetting": (2, 0),  # settings = 1, model_name = 2
}
STREAM_METHOD = "ModelStreamInfer"  # ModelInferRequest in, ModelStreamInferResponse out
# ModelInferRequest: model_name = 1, model_version = 2, id = 3.
STREAM_FIELDS = (1, 2, 3)
# Unary methods of other services that Triton serves: proxied like the service's own.
EXTRA_UNARY_PATHS = ("/grpc.health.v1.Health/Check",)
# The routes both engines take from the table: the service's unary methods by their path, and
# its stream's path (the relay classifies a call with them; grpc.aio registers a handler each).
UNARY_PATHS: dict[str, tuple[int, int]] = {
    f"/{SERVICE}/{name}": fields for name, fields in UNARY_METHODS.items()
}
STREAM_PATH = f"/{SERVICE}/{STREAM_METHOD}"
# The unary method whose request is a ModelInferRequest, like every ModelStreamInfer message: the
# calls a model's ``tokens`` bucket charges (sidecar.protocols.grpc_charge).
INFER_PATH = f"/{SERVICE}/ModelInfer"

# Status code number -> name (the metrics' ``code`` label), from the one table in telemetry.
CODE_NAMES = {number: name for name, number in GRPC_CODES.items()}
# The code names the sidecar itself writes or maps to: the one place they are spelled.
OK, CANCELLED, INVALID_ARGUMENT, NOT_FOUND = "OK", "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND"
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED = "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"
INTERNAL, UNAVAILABLE, UNKNOWN = "INTERNAL", "UNAVAILABLE", "UNKNOWN"
UNAUTHENTICATED, PERMISSION_DENIED, UNIMPLEMENTED = "UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED"
assert {
    OK,
    CANCELLED,
    INVALID_ARGUMENT,
    NOT_FOUND,
    DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED,
    INTERNAL,
    UNAVAILABLE,
    UNKNOWN,
    UNAUTHENTICATED,
    PERMISSION_DENIED,
    UNIMPLEMENTED,
} <= GRPC_CODES.keys()

# Triton drops the status code of an error inside ModelStreamInfer and sends only its message
# (unless the client asks for ``triton_grpc_error``, which ends the stream with the real
# status). These prefixes are the messages Triton writes for the client's own mistakes; any
# other in-stream error is the server's.
STREAM_CLIENT_ERRORS: tuple[tuple[str, str], ...] = (
    ("Request for unknown model", NOT_FOUND),
    ("unexpected inference input", INVALID_ARGUMENT),
    ("unexpected inference output", INVALID_ARGUMENT),
    ("expected ", INVALID_ARGUMENT),
    ("unexpected shape", INVALID_ARGUMENT),
    ("inference input", INVALID_ARGUMENT),
    ("input byte size mismatch", INVALID_ARGUMENT),
    ("unexpected explicit tensor data", INVALID_ARGUMENT),
)


def stream_error_code(message: str) -> str:
    """The gRPC code name an in-stream error message stands for (see STREAM_CLIENT_ERRORS)."""
    # Triton prefixes request errors with "[request id: <id>] ".
    if message.startswith("[request id:"):
        message = message.partition("] ")[2]
    for prefix, code in STREAM_CLIENT_ERRORS:
        if message.startswith(prefix):
            return code
    return INTERNAL


def span_attributes(method: str) -> tuple[str, dict[str, str]]:
    """Span name and attributes for one method, per the OpenTelemetry RPC conventions."""
    service, _, name = method.lstrip("/").rpartition("/")
    return f"{service}/{name}", {"rpc.service": service, "rpc.method": name}


def upstream_target(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
