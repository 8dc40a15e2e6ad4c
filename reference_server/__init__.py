"""The bundled reference server: a real Triton with dynamic batching, faults and load."""
