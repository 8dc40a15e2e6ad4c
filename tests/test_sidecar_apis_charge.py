"""sidecar/apis/charge.py: an LLM request's token cost read from its body at any split."""

from __future__ import annotations

import json

import pytest

from sidecar.apis.charge import DEFAULT_MAX_TOKENS, Charge
from sidecar.apis.routes import CHAT, EMBEDDINGS, MODELS, TRITON_GENERATE, classify


def charged(body: bytes, generates: bool = True, split: int = 0) -> Charge:
    charge = Charge(generates)
    parts = [body[:split], body[split:]] if split else [body]
    for part in parts:
        if charge.feed(part):
            break
    charge.finish()
    return charge


def prompt(body: bytes) -> int:
    return -(-len(body) // 4)


@pytest.mark.parametrize(
    ("fields", "generated"),
    [
        ({"max_tokens": 100}, 100),
        ({"max_completion_tokens": 30, "max_tokens": 100}, 30),  # the newer name wins
        ({"max_tokens": 100, "n": 3}, 300),
        ({}, DEFAULT_MAX_TOKENS),
        ({"n": 2}, 2 * DEFAULT_MAX_TOKENS),
        ({"max_tokens": -5}, 0),  # the upstream refuses it; nothing to charge
        ({"max_tokens": "100"}, DEFAULT_MAX_TOKENS),  # a wrong type is not a limit
    ],
)
def test_cost_is_the_prompt_estimate_plus_n_times_max_tokens(fields: dict, generated: int) -> None:
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi " * 50}], "model": "tiny-llm", **fields}
    ).encode()
    for split in (0, 1, len(body) // 2, len(body) - 1):
        charge = charged(body, split=split)
        assert charge.model == "tiny-llm"
        assert charge.tokens(len(body)) == prompt(body) + generated


def test_embeddings_and_bad_bodies() -> None:
    body = b'{"model": "e", "input": "some text", "max_tokens": 9}'
    assert charged(body, generates=False).tokens(len(body)) == prompt(body)
    cut = b'{"model": "m", "max_tokens": 7, "messages": ['
    c = charged(cut)  # cut short (or the hold window filled): what was read counts
    assert c.model == "m" and c.tokens(1000) == 250 + 7
    for bad in (b"not json", b"", b'{"model": 5, "max_tokens": 7}', b'{"max_tokens": 7}'):
        c = charged(bad)
        assert c.model is None


def test_feed_says_when_nothing_later_can_change_the_charge() -> None:
    every = b'{"model": "m", "max_tokens": 1, "max_completion_tokens": 2, "n": 1, "stream": true, "x": 1}'
    c = Charge(True)
    assert c.feed(every[:60]) is False
    assert c.feed(every[60:]) is True  # every field met: the body need not be held further
    assert Charge(True).feed(b"[1, 2]") is True  # not an object: nothing to read


def test_which_routes_charge() -> None:
    assert CHAT.charge() is not None and CHAT.charge().generates  # type: ignore[union-attr]
    assert EMBEDDINGS.charge() is not None and not EMBEDDINGS.charge().generates  # type: ignore[union-attr]
    assert TRITON_GENERATE.charge() is not None
    assert MODELS.charge() is None
    assert classify(b"/v2/models/ranker/infer") is None  # KServe v2: never held
