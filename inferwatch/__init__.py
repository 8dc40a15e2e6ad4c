"""inferwatch: observability and alerting for GPU inference fleets."""

__version__ = "0.1.0"
