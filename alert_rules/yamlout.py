"""Deterministic YAML: fixed key order as built, multi-line strings as literal blocks,
no aliases, so generated files diff cleanly and regenerate byte for byte."""

from __future__ import annotations

import yaml


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: object) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _str)


def dump(data: object, header: str = "") -> str:
    body = yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000, indent=2)
    return header + body
