"""``inferwatch spec check``: validate a fleet spec and summarize what it defines."""

from __future__ import annotations

import argparse
import sys

from inferwatch.paths import DEFAULT_SPEC
from inferwatch.spec import SpecError, duration_seconds, load_spec_for_cli


def register(sub: argparse._SubParsersAction) -> None:
    spec = sub.add_parser("spec", help="work with the fleet spec (fleet.yaml)")
    spec_sub = spec.add_subparsers(dest="spec_command", metavar="SUBCOMMAND", required=True)
    check = spec_sub.add_parser(
        "check",
        help="validate a fleet spec",
        description="Validate a fleet spec. A bad spec prints one line (file: field: reason) and exits 2.",
    )
    check.add_argument(
        "file", nargs="?", default=DEFAULT_SPEC, help="the spec to check (default: %(default)s)"
    )
    check.add_argument("-q", "--quiet", action="store_true", help="print nothing when the spec is valid")
    check.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    try:
        spec = load_spec_for_cli(args.file)
    except SpecError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not args.quiet:
        er = spec.alerts.error_rate
        lat = spec.alerts.latency
        gpu = spec.alerts.gpu_memory
        print(f"{args.file}: valid")
        print(
            f"  critical  error ratio > {er.threshold:.2%} in {er.consecutive_windows} consecutive "
            f"{er.window} windows (>= {er.consecutive_windows * duration_seconds(er.window):g}s)"
        )
        quantile = f"P{lat.quantile * 100:g}"
        print(f"  warning   {quantile} > {lat.sla_factor:g} x SLA over {lat.window}, held {lat.for_}")
        print(f"  info      GPU framebuffer used > {gpu.threshold:.0%}, held {gpu.for_}")
        print(f"  models    {len(spec.models)} (default SLA {spec.defaults.latency_sla_ms:g} ms)")
        for m in spec.models:
            slo = f", SLO {m.slo.objective:.3%} over {m.slo.period}" if m.slo else ""
            print(f"    - {m.name}: SLA {m.latency_sla_ms:g} ms{slo}")
    return 0
