"""The stack's own health: scrape targets down, a sidecar that cannot reach its model
server, GPU XID errors. A broken pipeline must not look like a healthy fleet."""

from __future__ import annotations

from alert_rules.config import XID_WINDOW, RulesConfig
from inferwatch import contract as c

NAME = "inferwatch-health"


def xid_expr() -> str:
    gpu = f"{c.L_GPU}, {c.L_UUID}, {c.L_HOSTNAME}"
    xid_total = c.GPU_XID_ERRORS_TOTAL.name
    dcgm = c.DCGM_XID_ERRORS.name
    # inferwatch's exporter counts every XID by code, creating a code's series at 1 on its
    # first XID: increase() cannot see that first one, so a series that appeared within the
    # window is an event too. dcgm-exporter only shows the last code, so on such fleets a
    # change to a non-zero code is the event.
    return (
        f"sum by ({gpu}, xid) (increase({xid_total}[{XID_WINDOW}])) > 0\n"
        f"or\n"
        f"sum by ({gpu}, xid) ({xid_total} unless {xid_total} offset {XID_WINDOW})\n"
        f"or\n"
        f"(\n  max by ({gpu}) ({dcgm} != 0 and changes({dcgm}[{XID_WINDOW}]) > 0)\n"
        f"  unless on ({c.L_UUID}) {xid_total}\n)"
    )


def group(cfg: RulesConfig) -> dict:
    jobs = "|".join(c.JOBS)
    gpu_labels = (
        f"GPU {{{{ $labels.{c.L_GPU} }}}} ({{{{ $labels.{c.L_UUID} }}}}) on {{{{ $labels.{c.L_HOSTNAME} }}}}"
    )
    return {
        "name": NAME,
        "rules": [
            {
                "alert": c.ALERT_TARGET_DOWN,
                "expr": f'{c.PROM_UP.name}{{job=~"{jobs}"}} == 0',
                "for": cfg.target_down_for,
                "labels": {"severity": c.SEVERITY_WARNING},
                "annotations": {
                    "summary": "{{ $labels.job }} target {{ $labels.instance }} is down",
                    "description": (
                        "Prometheus has failed to scrape {{ $labels.instance }} (job {{ $labels.job }}) "
                        f"for {cfg.target_down_for}. Its metrics are missing, so alerts that depend on "
                        "them cannot fire."
                    ),
                },
            },
            {
                "alert": c.ALERT_UPSTREAM_DOWN,
                "expr": f"{c.UPSTREAM_UP.name} == 0",
                "for": cfg.target_down_for,
                "labels": {"severity": c.SEVERITY_CRITICAL},
                "annotations": {
                    "summary": (
                        "sidecar {{ $labels.instance }} cannot reach model server {{ $labels.upstream }}"
                    ),
                    "description": (
                        "The sidecar at {{ $labels.instance }} has failed to reach its model server "
                        f"{{{{ $labels.upstream }}}} for {cfg.target_down_for}: no model behind it is "
                        "ready, and every request through it fails."
                    ),
                },
            },
            {
                "alert": c.ALERT_GPU_XID_ERRORS,
                "expr": xid_expr(),
                "labels": {"severity": c.SEVERITY_WARNING},
                "annotations": {
                    "summary": f"{gpu_labels} reported XID errors",
                    "description": (
                        f"The NVIDIA driver reported XID errors on {gpu_labels} in the last {XID_WINDOW} "
                        "(the xid label names the code where the exporter knows it). "
                        "Some XIDs (48, 63, 64, 74, 79, 94, 95) mean the GPU "
                        "needs draining and a reset."
                    ),
                },
            },
        ],
    }
