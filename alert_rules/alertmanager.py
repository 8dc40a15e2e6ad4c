"""alertmanager.yml from the fleet spec: severity routes, grouping, inhibition, receivers.

``render_alertmanager_config(spec, pager_token_file)`` returns the config as a dict;
``alertmanager_yaml`` the YAML text; ``write_alertmanager_config`` writes it with its
notification templates into a directory that Alertmanager can load as is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from alert_rules import yamlout
from inferwatch import contract as c
from inferwatch.spec import FleetSpec, Receiver

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE_FILES = ("inferwatch.tmpl",)
# PagerDuty knows critical, error, warning and info; our severities map onto them.
_PD_SEVERITY = "{{ if .CommonLabels.severity }}{{ .CommonLabels.severity }}{{ else }}error{{ end }}"


def _receiver(receiver: Receiver, pager_token_file: str | None) -> dict:
    out: dict = {"name": receiver.name}
    if receiver.webhooks:
        hooks = []
        for hook in receiver.webhooks:
            cfg: dict = {"url": hook.url, "send_resolved": hook.send_resolved, "max_alerts": 0}
            # A token named in the spec wins; else the local pager's token file, if given.
            if hook.bearer_token_file:
                cfg["http_config"] = {
                    "authorization": {"type": "Bearer", "credentials_file": hook.bearer_token_file}
                }
            elif hook.bearer_token:
                cfg["http_config"] = {"authorization": {"type": "Bearer", "credentials": hook.bearer_token}}
            elif pager_token_file:
                cfg["http_config"] = {
                    "authorization": {"type": "Bearer", "credentials_file": pager_token_file}
                }
            hooks.append(cfg)
        out["webhook_configs"] = hooks
    if receiver.pagerduty:
        out["pagerduty_configs"] = [
            {
                "routing_key_file": pd.routing_key_file,
                "send_resolved": pd.send_resolved,
                "severity": _PD_SEVERITY,
                "description": '{{ template "inferwatch.title" . }}',
                "details": {"summary": '{{ template "inferwatch.text" . }}'},
                "links": [{"href": '{{ template "inferwatch.runbook" . }}', "text": "runbook"}],
            }
            for pd in receiver.pagerduty
        ]
    if receiver.slack:
        out["slack_configs"] = [
            {
                "api_url_file": sl.api_url_file,
                "channel": sl.channel,
                "send_resolved": sl.send_resolved,
                "title": '{{ template "inferwatch.title" . }}',
                "title_link": '{{ template "inferwatch.runbook" . }}',
                "text": '{{ template "inferwatch.text" . }}',
            }
            for sl in receiver.slack
        ]
    return out


def render_alertmanager_config(
    spec: FleetSpec, pager_token_file: str | None = None, templates_glob: str = "templates/*.tmpl"
) -> dict:
    """The Alertmanager config for ``spec``.

    ``pager_token_file``: a file holding the bearer token of ``inferwatch pager``; every
    webhook that names no token of its own sends it. A relative path is resolved by
    Alertmanager against the config file's directory. ``templates_glob`` likewise.
    """
    routing = spec.routing
    routes = []
    for severity in c.SEVERITIES:
        route = getattr(routing, severity)
        routes.append(
            {
                "receiver": route.receiver,
                "matchers": [f'severity="{severity}"'],
                "group_wait": route.group_wait,
                "group_interval": route.group_interval,
                "repeat_interval": route.repeat_interval,
            }
        )
    # Anything without a known severity still reaches someone: the warning receiver.
    fallback = routing.warning
    return {
        "global": {"resolve_timeout": "5m"},
        "templates": [templates_glob],
        "route": {
            "receiver": fallback.receiver,
            "group_by": list(routing.group_by),
            "group_wait": fallback.group_wait,
            "group_interval": fallback.group_interval,
            "repeat_interval": fallback.repeat_interval,
            "routes": routes,
        },
        "inhibit_rules": [
            # A model's critical alert (error rate, fast SLO burn) says everything its
            # warnings and infos would; the model label must be present on the source, else
            # a model-less critical would silence every model-less warning.
            {
                "source_matchers": [f'severity="{c.SEVERITY_CRITICAL}"', f'{c.L_MODEL}=~".+"'],
                "target_matchers": [f'severity=~"{c.SEVERITY_WARNING}|{c.SEVERITY_INFO}"'],
                "equal": [c.L_MODEL],
            },
            # A GPU with XID errors does not also need a memory-pressure note.
            {
                "source_matchers": [
                    f'severity=~"{c.SEVERITY_CRITICAL}|{c.SEVERITY_WARNING}"',
                    f'{c.L_UUID}=~".+"',
                ],
                "target_matchers": [f'severity="{c.SEVERITY_INFO}"'],
                "equal": [c.L_UUID],
            },
        ],
        "receivers": [_receiver(r, pager_token_file) for r in routing.receivers],
    }


HEADER = (
    "# Generated by `inferwatch rules build` from the fleet spec; do not edit.\n"
    "# Routes: critical pages, warning opens a ticket, info goes to a low-urgency receiver.\n"
)


def alertmanager_yaml(spec: FleetSpec, pager_token_file: str | None = None) -> str:
    return yamlout.dump(render_alertmanager_config(spec, pager_token_file), HEADER)


def write_alertmanager_config(
    spec: FleetSpec, out_dir: Path, pager_token_file: str | None = None
) -> list[Path]:
    """Writes ``alertmanager.yml`` and ``templates/*.tmpl`` into ``out_dir``; returns the paths."""
    out_dir = Path(out_dir)
    (out_dir / "templates").mkdir(parents=True, exist_ok=True)
    config = out_dir / "alertmanager.yml"
    config.write_text(alertmanager_yaml(spec, pager_token_file), encoding="utf-8")
    paths = [config]
    for name in TEMPLATE_FILES:
        dest = out_dir / "templates" / name
        shutil.copyfile(TEMPLATES_DIR / name, dest)
        paths.append(dest)
    return paths
