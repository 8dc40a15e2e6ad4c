"""Request-level metrics sidecar: a transparent HTTP and gRPC proxy for model servers."""
