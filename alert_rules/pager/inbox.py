"""The HTML inbox: what is firing, worst first, readable at a glance on a 1280 px screen.

No script at all (the page refreshes itself with a meta tag), so the Content-Security-Policy
can forbid every script; the one style block is allowed by its hash.
"""

from __future__ import annotations

import base64
import hashlib
import html
from datetime import UTC, datetime
from urllib.parse import urlencode

from .payload import parse_time

REFRESH_SECONDS = 30
# Labels that have their own column or are the row's title.
_SHOWN = ("alertname", "severity", "model", "version")

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 16px 20px; color: #1d1d1f; }
h1 { font-size: 20px; margin: 0 0 4px; }
.summary { margin: 0 0 10px; } .summary .firing { color: #b3261e; font-weight: 600; }
.meta { color: #666; font-size: 12px; }
nav { margin: 8px 0; } nav a { margin-right: 12px; }
table { border-collapse: collapse; width: 100%; table-layout: fixed; }
th { text-align: left; font-size: 12px; color: #555; border-bottom: 2px solid #ccc; padding: 4px 6px; }
td { border-bottom: 1px solid #e3e3e3; padding: 6px; vertical-align: top; overflow-wrap: anywhere; }
col.c-state { width: 112px; } col.c-model { width: 150px; } col.c-since { width: 150px; }
col.c-links { width: 96px; } col.c-recv { width: 110px; }
.badge { display: inline-block; border-radius: 3px; padding: 1px 6px; font-size: 12px; font-weight: 600; }
.sev-critical { background: #b3261e; color: #fff; } .sev-warning { background: #f2a60d; color: #1d1d1f; }
.sev-info { background: #d6e4f5; color: #17375e; } .sev-other { background: #e3e3e3; color: #1d1d1f; }
.status { display: block; font-size: 12px; margin-top: 2px; }
tr.firing .status { color: #b3261e; font-weight: 600; } tr.resolved .status { color: #2e7d32; }
tr.firing.critical td:first-child { border-left: 4px solid #b3261e; }
tr.resolved td { color: #666; } tr.resolved .badge { opacity: 0.6; }
.name { font-weight: 600; } .desc { color: #444; font-size: 13px; } .labels { color: #777; font-size: 12px; }
.links a { display: block; }
"""
STYLE_HASH = "sha256-" + base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()


def human_duration(seconds: float) -> str:
    """12m, 3h 5m, 2d 4h: the two largest units."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    parts = [(s // 86400, "d"), (s % 86400 // 3600, "h"), (s % 3600 // 60, "m")]
    while parts and parts[0][0] == 0:
        parts.pop(0)
    return " ".join(f"{n}{u}" for n, u in parts[:2] if n)


def utc_text(when: datetime) -> str:
    text = when.strftime("%Y-%m-%d %H:%M:%S")
    if when.microsecond:
        text += f".{when.microsecond // 1000:03d}"
    return text + " UTC"


def _link(url: str, text: str) -> str:
    if not url.startswith(("http://", "https://")):
        return ""
    return f'<a href="{html.escape(url, quote=True)}" rel="noreferrer">{text}</a>'


def _since(page: dict, now: datetime) -> str:
    start = parse_time(page["starts_at"])
    start_iso = html.escape(page["starts_at"], quote=True)
    if page["status"] == "firing":
        return (
            f'<time datetime="{start_iso}" title="firing since {utc_text(start)}">'
            f"firing for {human_duration((now - start).total_seconds())}</time>"
        )
    end = parse_time(page["ends_at"])
    return (
        f'<time datetime="{html.escape(page["ends_at"], quote=True)}" '
        f'title="fired {utc_text(start)}, resolved {utc_text(end)}">'
        f"resolved {human_duration((now - end).total_seconds())} ago</time>"
        f'<div class="meta">lasted {human_duration((end - start).total_seconds())}</div>'
    )


def _row(page: dict, now: datetime) -> str:
    e = html.escape
    sev = page["severity"]
    sev_class = sev if sev in ("critical", "warning", "info") else "other"
    ann = page["annotations"]
    labels = page["labels"]
    if page["model"]:
        version = f' <span class="meta">v{e(page["version"])}</span>' if page["version"] else ""
        target = e(page["model"]) + version
    else:
        # GPU and target alerts: what identifies the broken thing.
        target = "".join(
            f'<div><span class="meta">{e(k)}</span> {e(labels[k])}</div>'
            for k in ("Hostname", "gpu", "upstream", "instance")
            if k in labels
        )
    rest = ", ".join(f"{e(k)}={e(v)}" for k, v in sorted(labels.items()) if k not in _SHOWN)
    desc = ann.get("description", "")
    links = _link(ann.get("runbook_url", ""), "runbook") + _link(ann.get("dashboard_url", ""), "dashboard")
    return (
        f'<tr class="{e(page["status"])} {e(sev_class)}">'
        f'<td><span class="badge sev-{sev_class}">{e(sev or "none")}</span>'
        f'<span class="status">{e(page["status"])}</span></td>'
        f'<td><div class="name">{e(page["alertname"])}</div>'
        f'<div class="summary-text">{e(ann.get("summary", ""))}</div>'
        + (f'<div class="desc">{e(desc)}</div>' if desc else "")
        + (f'<div class="labels">{rest}</div>' if rest else "")
        + f"</td><td>{target}</td><td>{_since(page, now)}</td>"
        f'<td class="links">{links}</td><td>{e(page["receiver"])}</td></tr>'
    )


def render(
    pages: list[dict],
    counts: dict[str, int],
    filters: dict[str, str],
    limit: int,
    offset: int,
    now: datetime | None = None,
) -> str:
    """The inbox page: ``pages`` is one page of the list, ``counts`` its totals."""
    now = now or datetime.now(UTC)
    e = html.escape
    total = counts["pages"]
    rows = "\n".join(_row(p, now) for p in pages) or '<tr><td colspan="6">No pages.</td></tr>'
    first, last = (offset + 1, offset + len(pages)) if pages else (0, 0)
    nav = []
    if offset > 0:
        nav.append(("newer", max(0, offset - limit)))
    if offset + len(pages) < total:
        nav.append(("older", offset + limit))
    nav_html = "".join(
        f'<a href="?{e(urlencode({**filters, "limit": limit, "offset": off}), quote=True)}">{label}</a>'
        for label, off in nav
    )
    filtered = ", ".join(f"{e(k)}={e(v)}" for k, v in filters.items())
    critical = counts["firing_critical"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>inferwatch pager ({counts["firing"]} firing)</title>
<style>{STYLE}</style></head><body>
<h1>inferwatch pager</h1>
<p class="summary"><span class="firing">{counts["firing"]} firing</span>
({critical} critical), {counts["resolved"]} resolved{f" matching {filtered}" if filtered else ""};
{counts["notifications"]} notifications received.</p>
<p class="meta">Showing {first}&ndash;{last} of {total}, firing first, then by severity.
Updated {utc_text(now.replace(microsecond=0))}; refreshes every {REFRESH_SECONDS} s.</p>
<nav>{nav_html}</nav>
<table>
<colgroup><col class="c-state"><col><col class="c-model"><col class="c-since"><col class="c-links">
<col class="c-recv"></colgroup>
<thead><tr><th>severity</th><th>alert</th><th>model / target</th><th>since</th><th>links</th>
<th>receiver</th></tr></thead>
<tbody>
{rows}
</tbody></table>
<nav>{nav_html}</nav>
</body></html>
"""
