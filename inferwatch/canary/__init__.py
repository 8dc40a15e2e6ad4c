"""Canary analysis: is a new model version worse than the one it replaces?

``judge(prometheus_url, model, baseline, canary)`` returns a ``Report`` whose ``verdict`` is
``pass``, ``fail`` (roll back) or ``inconclusive`` (too little traffic), with one ``Check``
per comparison saying why. ``inferwatch canary`` prints it; ``templates`` renders the same
analysis for Argo Rollouts and Flagger; ``alert_rules/groups/canary.py`` alerts on it.

It lives in ``inferwatch/`` rather than in a component folder of its own: it runs no
process, it reads what the sidecar's metrics put in Prometheus, and the CLI, the rule
generator, the deploy templates and the demo all share it.
"""

from inferwatch.canary.analysis import (
    EXIT_CODES,
    EXIT_ERROR,
    FAIL,
    INCONCLUSIVE,
    PASS,
    CanaryError,
    Check,
    Report,
    judge,
)

__all__ = [
    "EXIT_CODES",
    "EXIT_ERROR",
    "FAIL",
    "INCONCLUSIVE",
    "PASS",
    "CanaryError",
    "Check",
    "Report",
    "judge",
]
