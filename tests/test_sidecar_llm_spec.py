"""The fleet spec's served names: an engine's names for one model, each standing for a version."""

from __future__ import annotations

import pytest

from inferwatch.spec import SpecError, load_spec, parse_spec
from tests.fixtures.net import ROOT


def _spec(models: list[dict]) -> dict:
    return {"version": 1, "models": models}


def test_served_names_map_to_model_and_version() -> None:
    spec = parse_spec(
        _spec([{"name": "llm", "latency_sla_ms": 1000, "served_names": {"llm": "1", "llm-canary": "2"}}])
    )
    assert spec.served_names() == {"llm": ("llm", "1"), "llm-canary": ("llm", "2")}


def test_the_repository_specs_map_the_vllm_canary_name() -> None:
    for path in ("fleet.yaml", "fleet.demo.yaml"):
        assert load_spec(ROOT / path).served_names()["tiny-llm-canary"] == ("tiny-llm", "2"), path


@pytest.mark.parametrize(
    ("models", "error"),
    [
        (
            [
                {"name": "a", "latency_sla_ms": 1, "served_names": {"x": "1"}},
                {"name": "b", "latency_sla_ms": 1, "served_names": {"x": "2"}},
            ],
            "'x' is already a served name of 'a'",
        ),
        (
            [
                {"name": "a", "latency_sla_ms": 1, "served_names": {"b": "1"}},
                {"name": "b", "latency_sla_ms": 1},
            ],
            "'b' is the name of another model",
        ),
        ([{"name": "a", "latency_sla_ms": 1, "served_names": {"a": "v 1"}}], "served_names"),
        ([{"name": "a", "latency_sla_ms": 1, "served_names": {"a b": "1"}}], "served_names"),
    ],
)
def test_bad_served_names_are_refused_with_one_line(models: list[dict], error: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_spec(_spec(models))
    assert error in str(exc.value)
