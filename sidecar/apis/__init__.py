"""Generative-serving protocol modules of the sidecar: see README.md."""
