"""Alert pipeline benchmark: from a fault injected into Triton to the page at the receiver.

Starts the local stack with the demo spec (fleet.demo.yaml) on free ports in a temporary
state dir, plays the demo's incident ``--runs`` times on it, and prints, per fault, the
detection delay against the theoretical minimum computed from the spec (the rule's
condition time + one evaluation interval + the route's group wait), and the time from
recovery to the resolved notification. Markdown on stdout, for benchmarks/RESULTS.md.

    .venv/bin/python benchmarks/alert_pipeline.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from inferwatch import logs  # noqa: E402
from inferwatch.spec import duration_seconds  # noqa: E402
from inferwatch.stack import Stack, StackConfig, free_ports  # noqa: E402
from inferwatch.stack.demo import Demo, Scenario  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=ROOT / "fleet.demo.yaml")
    parser.add_argument("--runs", type=int, default=1, help="incidents to play on one stack (default 1)")
    parser.add_argument(
        "--rate", type=float, default=Scenario().rate, help="steady request rate (default %(default)s/s)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write every run's results here")
    args = parser.parse_args()
    logs.setup("warning", "inferwatch", "logfmt")

    rows: list[dict] = []
    raw = []
    stray = 0
    with tempfile.TemporaryDirectory(prefix="inferwatch-bench-") as tmp:
        config = StackConfig(
            spec_path=args.spec, state_dir=Path(tmp) / "stack", ports=free_ports(), gpu_backend="simulated"
        )
        with Stack(config) as stack:
            assert stack.info is not None
            spec = stack.info.spec()
            for run in range(1, args.runs + 1):
                print(f"run {run}/{args.runs} ...", file=sys.stderr, flush=True)
                result = Demo(stack.info, spec, Scenario(rate=args.rate), threading.Event()).run()
                raw.append(result.to_json())
                stray += len(result.steady_pages) + len(result.unexpected_pages)
                for f in result.faults:
                    rows.append(
                        {
                            "run": run,
                            "fault": f.key,
                            "alert": f"{f.alertname} [{f.severity}]",
                            "delay": f.delay_s,
                            "minimum": f.minimum_s,
                            "resolve": f.resolve_delay_s,
                            # Prometheus' activeAt before the injection: the alert was already
                            # pending (the machine, not the fault), so its page times nothing.
                            "early": f.active_at is not None
                            and f.injected_at is not None
                            and f.active_at < f.injected_at,
                        }
                    )
                if not result.ok:
                    print(f"run {run}: {'; '.join(result.problems())}", file=sys.stderr)

    er, lat, gpu = spec.alerts.error_rate, spec.alerts.latency, spec.alerts.gpu_memory
    waits = "/".join(r.group_wait for r in (spec.routing.critical, spec.routing.warning, spec.routing.info))
    print(
        f"Spec {args.spec.name}: scrape every {spec.prometheus.scrape_interval}, evaluation every "
        f"{spec.prometheus.evaluation_interval}; "
        f"errors > {er.threshold:.0%} in {er.consecutive_windows} x {er.window} windows; "
        f"P{lat.quantile * 100:g} > {lat.sla_factor:g} x SLA over {lat.window} for {lat.for_}; "
        f"GPU memory > {gpu.threshold:.0%} for {gpu.for_}; group_wait {waits} "
        f"(critical/warning/info). {args.runs} run(s), steady traffic {args.rate:g} req/s.\n"
    )
    print(
        "| fault | alert | theoretical min | delay (median) | delay (min-max) | delay/min | resolved after |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for key in dict.fromkeys(r["fault"] for r in rows):
        mine = [r for r in rows if r["fault"] == key]
        early = sum(r["early"] for r in mine)
        delays = [r["delay"] for r in mine if r["delay"] is not None and not r["early"]]
        resolves = [r["resolve"] for r in mine if r["resolve"] is not None]
        minimum = mine[0]["minimum"]
        lost = sum(r["delay"] is None for r in mine)
        med = statistics.median(delays) if delays else None
        print(
            f"| {key} | {mine[0]['alert']} | {minimum:g}s | "
            + (
                f"{med:.1f}s | {min(delays):.1f}-{max(delays):.1f}s | {med / minimum:.2f}x | "
                if delays
                else "- | - | - | "
            )
            + (f"{statistics.median(resolves):.1f}s" if resolves else "-")
            + (f" ({lost} lost)" if lost else "")
            + (f" ({early} already pending before the fault, left out)" if early else "")
            + " |"
        )
    print(
        f"\nevaluation interval {duration_seconds(spec.prometheus.evaluation_interval):g}s; "
        "'resolved after' is from clearing the fault to the resolved notification; a run whose "
        "alert was already pending when its fault was injected is left out of the delays; "
        f"pages no fault explains (steady phase included): {stray}."
    )
    if args.json:
        args.json.write_text(json.dumps(raw, indent=2))
    return 0 if all(r["delay"] is not None and r["resolve"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
