"""The reference models on the real Triton: the numbers they serve, their batching, their errors."""

from __future__ import annotations

import filecmp
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from inferwatch import contract
from reference_server import catalog, triton_metrics
from tests.fixtures.triton import expected

pytestmark = pytest.mark.integration


def http_infer(url: str, model: str, x: np.ndarray, version: str = "") -> np.ndarray:
    info = catalog.model_info(model)
    client = httpclient.InferenceServerClient(url)
    inp = httpclient.InferInput(info.input.name, list(x.shape), info.input.datatype)
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], model_version=version).as_numpy(info.output.name)


def grpc_infer(url: str, model: str, x: np.ndarray, version: str = "") -> np.ndarray:
    info = catalog.model_info(model)
    client = grpcclient.InferenceServerClient(url)
    inp = grpcclient.InferInput(info.input.name, list(x.shape), info.input.datatype)
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp], model_version=version).as_numpy(info.output.name)


def test_every_model_file_is_the_same_shim() -> None:
    """Each version's model.py only imports the shared reference_models.py, so no model can
    drift from the others."""
    files = sorted(catalog.MODEL_REPOSITORY.glob("*/*/model.py"))
    models = [*catalog.MODELS.values(), *catalog.STREAM_MODELS.values()]
    assert len(files) == sum(len(m.versions) for m in models)
    for f in files[1:]:
        assert filecmp.cmp(files[0], f, shallow=False), f"{f} differs from {files[0]}"
    assert "from reference_models import TritonPythonModel" in files[0].read_text()


# Triton's config says TYPE_STRING where the KServe v2 protocol (and the catalog) say BYTES.
CONFIG_TYPE = {"BYTES": "TYPE_STRING"}


def test_catalog_matches_what_triton_serves(triton) -> None:
    client = httpclient.InferenceServerClient(triton.http_url)
    index = {(m["name"], m.get("version", "")) for m in client.get_model_repository_index()}
    listed = {
        (m.name, v) for m in (*catalog.MODELS.values(), *catalog.STREAM_MODELS.values()) for v in m.versions
    }
    assert index == listed, "every served model is in the catalog and the other way round"
    for info in catalog.STREAM_MODELS.values():
        cfg = client.get_model_config(info.name)
        assert cfg["model_transaction_policy"] == {"decoupled": True}
        assert cfg["max_batch_size"] == info.max_batch_size and "dynamic_batching" not in cfg
        for want, got in ((info.inputs, cfg["input"]), (info.outputs, cfg["output"])):
            assert [
                (t.name, CONFIG_TYPE.get(t.datatype, f"TYPE_{t.datatype}"), list(t.shape)) for t in want
            ] == [(g["name"], g["data_type"], [int(d) for d in g["dims"]]) for g in got]
        assert [bool(g.get("optional")) for g in cfg["input"]] == [False] + [True] * (len(info.inputs) - 1)
        params = {k: v["string_value"] for k, v in cfg["parameters"].items()}
        for v in info.versions:
            assert float(params.get(f"v{v}_ttft_ms", params["ttft_ms"])) == info.ttft_ms[v]
            assert float(params.get(f"v{v}_per_token_ms", params["per_token_ms"])) == info.per_token_ms[v]
        assert int(params["default_max_tokens"]) == info.default_max_tokens
        assert int(params["max_tokens_limit"]) == info.max_tokens_limit
    for info in catalog.MODELS.values():
        for v in info.versions:
            assert (info.name, v) in index
            assert client.is_model_ready(info.name, v)
        cfg = client.get_model_config(info.name)
        assert cfg["max_batch_size"] == info.max_batch_size
        assert ("dynamic_batching" in cfg) == info.dynamic_batching
        for want, got in ((info.inputs, cfg["input"]), (info.outputs, cfg["output"])):
            assert [(t.name, f"TYPE_{t.datatype}", list(t.shape)) for t in want] == [
                (g["name"], g["data_type"], [int(d) for d in g["dims"]]) for g in got
            ]
        for (model, version), seed in catalog.WEIGHT_SEEDS.items():
            if model == info.name:
                key = "seed" if model.startswith("dense") else f"v{version}_seed"
                assert cfg["parameters"][key]["string_value"] == str(seed)
    assert catalog.model_info("dense_batched").max_batch_size >= 8
    cfg = client.get_model_config("dense_batched")["dynamic_batching"]
    assert [int(b) for b in cfg["preferred_batch_size"]] == [4, 8]
    assert int(cfg["max_queue_delay_microseconds"]) == 1000


@pytest.mark.parametrize(("model", "version"), sorted(catalog.WEIGHT_SEEDS))
def test_http_and_grpc_serve_the_numpy_reference(triton, model: str, version: str) -> None:
    x = catalog.example_input(model, batch=3, seed=7)[catalog.model_info(model).input.name]
    want = expected(model, version, x)
    for infer, url in ((http_infer, triton.http_url), (grpc_infer, triton.grpc_url)):
        got = infer(url, model, x, version)
        assert got.shape == want.shape
        # Summation order differs (batched BLAS, blockwise dequantization): compare to scale.
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()) + 1e-5)


def test_ranker_versions_differ_and_the_default_is_the_newest(triton) -> None:
    x = catalog.example_input("ranker", seed=3)["FEATURES"]
    v1 = http_infer(triton.http_url, "ranker", x, "1")
    v2 = http_infer(triton.http_url, "ranker", x, "2")
    assert not np.allclose(v1, v2)
    np.testing.assert_allclose(http_infer(triton.http_url, "ranker", x), v2, rtol=1e-5)


def _concurrent_load(url: str, model: str, requests: int, workers: int) -> None:
    x = catalog.example_input(model, seed=1)["INPUT"]

    def one(_: int) -> None:
        http_infer(url, model, x)

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, range(requests)))


@pytest.mark.parametrize(
    ("batched", "unbatched"),
    [("dense_batched", "dense_unbatched"), ("dense_int4_batched", "dense_int4_unbatched")],
)
def test_dynamic_batching_merges_requests_and_the_baseline_does_not(
    triton, batched: str, unbatched: str
) -> None:
    n = 64
    before = triton_metrics.scrape(triton.metrics_url)
    for model in (batched, unbatched):
        _concurrent_load(triton.http_url, model, requests=n, workers=16)
    after = triton_metrics.scrape(triton.metrics_url)
    count_name, exec_name = contract.TRITON_INFERENCE_COUNT.name, contract.TRITON_EXEC_COUNT.name
    count = triton_metrics.delta(before, after, count_name, batched)
    execs = triton_metrics.delta(before, after, exec_name, batched)
    assert count == n
    assert execs < count, f"{batched} ran {execs} executions for {count} requests"
    count = triton_metrics.delta(before, after, count_name, unbatched)
    execs = triton_metrics.delta(before, after, exec_name, unbatched)
    assert count == n
    assert execs == count


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_tritons_error_and_the_server_stays_up(triton, protocol: str) -> None:
    client_mod = httpclient if protocol == "http" else grpcclient
    url = triton.http_url if protocol == "http" else triton.grpc_url
    client = client_mod.InferenceServerClient(url)
    good = np.zeros((1, catalog.DENSE_DIM), np.float32)

    def infer(model: str, x: np.ndarray, datatype: str) -> None:
        inp = client_mod.InferInput("INPUT", list(x.shape), datatype)
        inp.set_data_from_numpy(x)
        client.infer(model, [inp])

    cases = {
        "unknown model": (lambda: infer("no_such_model", good, "FP32"), ("404", "StatusCode.NOT_FOUND")),
        "wrong shape": (
            lambda: infer("dense_batched", np.zeros((1, 17), np.float32), "FP32"),
            ("400", "StatusCode.INVALID_ARGUMENT"),
        ),
        "wrong dtype": (
            lambda: infer("dense_batched", good.astype(np.int32), "INT32"),
            ("400", "StatusCode.INVALID_ARGUMENT"),
        ),
    }
    for what, (call, statuses) in cases.items():
        with pytest.raises(InferenceServerException) as err:
            call()
        status = str(err.value.status())
        assert status == statuses[protocol == "grpc"], f"{what}: {status} {err.value.message()}"
        assert err.value.message(), what
    assert client.is_server_live() and client.is_server_ready()
    np.testing.assert_allclose(
        http_infer(triton.http_url, "dense_batched", good), np.zeros((1, catalog.DENSE_DIM)), atol=0
    )
