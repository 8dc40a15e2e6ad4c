"""Dashboard identities: titles, stable uids and the URLs alerts link to.

The uid of a dashboard derives from its name alone, so it never changes between
builds, between fleets, or between a Grafana provisioned from files and one where the
JSON was imported by hand; an alert's ``dashboard_url`` therefore stays valid.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from inferwatch.spec import FleetSpec

# name -> title. The name is what code refers to; the title is what Grafana shows.
FLEET_OVERVIEW = "fleet-overview"
MODEL_DETAIL = "model-detail"
GPU = "gpu"
LLM_SERVING = "llm-serving"
TITLES: dict[str, str] = {
    FLEET_OVERVIEW: "inferwatch / Fleet overview",
    MODEL_DETAIL: "inferwatch / Model detail",
    GPU: "inferwatch / GPU",
    LLM_SERVING: "inferwatch / LLM serving",
}
UID_PREFIX = "inferwatch-"


def slug(title: str) -> str:
    """Grafana's slug of a title: lower case, runs of other characters become one dash."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _name(name: str) -> str:
    if name in TITLES:
        return name
    for key, title in TITLES.items():
        if name == title:
            return key
    raise KeyError(f"unknown dashboard {name!r}; known: {', '.join(TITLES)}")


def uid(name: str) -> str:
    """The stable uid of dashboard ``name`` (a key of TITLES or its title), under Grafana's 40 chars."""
    return UID_PREFIX + _name(name)


def path(name: str) -> str:
    """The dashboard's path under the Grafana root: ``/d/<uid>/<slug>``."""
    key = _name(name)
    return f"/d/{uid(key)}/{slug(TITLES[key])}"


def dashboard_url(spec: FleetSpec, name: str, variables: Mapping[str, str] | None = None) -> str:
    """``<links.grafana_url>/d/<uid>/<slug>``, with ``var-NAME=VALUE`` parameters for ``variables``.

    Values are placed as given (not percent-encoded) so that alert templates such as
    ``{{ $labels.model }}`` survive into the rule file and are expanded by Prometheus.
    """
    url = spec.links.grafana_url.rstrip("/") + path(name)
    if variables:
        url += "?" + "&".join(f"var-{k}={v}" for k, v in variables.items())
    return url
