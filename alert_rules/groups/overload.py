"""Overload protection: a model whose per-model limits (the fleet spec's ``limits``, enforced
by the sidecar) shed more than ``alerts.load_shedding.threshold`` of its requests over
``alerts.load_shedding.window``, held ``for`` (InferenceLoadShedding, warning).

Shed requests are also in the requests counter (429 / RESOURCE_EXHAUSTED), so the ratio is
shed / all requests the sidecars saw for the model, summed over sidecars and versions (the shed
counter has no version: a request is shed before its answer could name one).
"""

from __future__ import annotations

from alert_rules.config import RulesConfig
from inferwatch import contract as c

NAME = "inferwatch-overload"


def ratio_expr(cfg: RulesConfig) -> str:
    shed, total, w = c.REQUESTS_SHED.name, c.REQUESTS_TOTAL.name, cfg.shed_window
    return f"sum by ({c.L_MODEL}) (rate({shed}[{w}]))\n/\nsum by ({c.L_MODEL}) (rate({total}[{w}]))"


def alert_expr(cfg: RulesConfig) -> str:
    return f"{c.REC_SHED_RATIO} > {cfg.shed_threshold:g}"


def group(cfg: RulesConfig) -> dict:
    model = f"{{{{ $labels.{c.L_MODEL} }}}}"
    return {
        "name": NAME,
        "rules": [
            {"record": c.REC_SHED_RATIO, "expr": ratio_expr(cfg)},
            {
                "alert": c.ALERT_LOAD_SHEDDING,
                "expr": alert_expr(cfg),
                "for": cfg.shed_for,
                "labels": {"severity": c.SEVERITY_WARNING},
                "annotations": {
                    "summary": f"{model}: {{{{ $value | humanizePercentage }}}} of requests shed",
                    "description": (
                        f"The sidecars' limits for {model} shed more than {cfg.shed_threshold:.1%} of its "
                        f"requests over {cfg.shed_window}, for {cfg.shed_for}: clients get 429 or "
                        "RESOURCE_EXHAUSTED. Demand is above the capacity the limits allow: add "
                        "replicas, or raise the limits if the server has headroom."
                    ),
                },
            },
        ],
    }
