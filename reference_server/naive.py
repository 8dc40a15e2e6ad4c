"""The naive baseline: the dense numpy models behind a plain FastAPI server, one request at a time.

It speaks the KServe v2 HTTP protocol (JSON tensors and Triton's binary-data extension), so
``inferwatch load`` and any tritonclient drive it exactly as they drive Triton. The inference
runs inline on the event loop: requests are served strictly one after another, with no
batching, as the "plain web server" the source material measures Triton against.

Run: ``inferwatch naive-server [--port 8030]`` or ``python -m reference_server.naive``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from reference_server import catalog
from reference_server.defaults import NAIVE_SERVER_PORT

DEFAULT_PORT = NAIVE_SERVER_PORT
HEADER_LENGTH = "Inference-Header-Content-Length"
_DTYPES = {"FP32": np.float32, "FP64": np.float64, "FP16": np.float16, "INT32": np.int32, "INT64": np.int64}
log = logging.getLogger("inferwatch.naive")


def _model_py():
    """The repository's model code, imported as a plain module (without Triton), so the naive
    server computes with exactly the same weights and compute paths as the Triton models."""
    import importlib.util
    import types

    sys.modules.setdefault("triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    path = catalog.MODEL_REPOSITORY / "reference_models.py"
    spec = importlib.util.spec_from_file_location("reference_model_py", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: its dataclasses look their module up there
    # No __pycache__ in the model repository: Triton would take that folder for a model.
    before, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = before
    return module


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _parse_request(body: bytes, header_length: str | None) -> tuple[dict, bytes]:
    try:
        n = int(header_length) if header_length is not None else len(body)
        header = json.loads(body[:n])
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed inference request: {exc}") from None
    if not isinstance(header, dict):
        raise BadRequest("malformed inference request: the JSON header is not an object")
    return header, body[n:]


def _input_array(spec: dict, binary: bytes, offset: int) -> tuple[np.ndarray, int]:
    try:
        name, shape, datatype = spec["name"], [int(d) for d in spec["shape"]], spec["datatype"]
    except (KeyError, TypeError, ValueError):
        raise BadRequest("each input needs name, shape and datatype") from None
    dtype = _DTYPES.get(datatype)
    if dtype is None:
        raise BadRequest(f"input '{name}': unsupported datatype {datatype}")
    size = (spec.get("parameters") or {}).get("binary_data_size")
    try:
        if size is not None:
            arr = np.frombuffer(
                binary, dtype=dtype, count=int(size) // np.dtype(dtype).itemsize, offset=offset
            )
            offset += int(size)
        else:
            arr = np.asarray(spec.get("data"), dtype=dtype)
        return arr.reshape(shape), offset
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"input '{name}': data does not match shape {shape} and {datatype}: {exc}") from None


class NaiveServer:
    """The dense model of the reference repository, served one request at a time."""

    def __init__(self, dim: int = catalog.DENSE_DIM) -> None:
        m = _model_py()
        self.dim = dim
        # One weight set per compute path, shared by the models that use it (as in Triton).
        computes: dict[tuple[str, int], Callable[[np.ndarray], np.ndarray]] = {}
        self.compute: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
        for name, info in catalog.MODELS.items():
            if not info.compute:
                continue
            seed = catalog.WEIGHT_SEEDS[(name, "1")]
            if (info.compute, seed) not in computes:
                if info.compute == "float32":
                    w = m.make_weights(seed, (dim, dim))
                    computes[(info.compute, seed)] = lambda x, w=w: x @ w
                else:
                    int4 = m.make_int4_weights(seed, dim)
                    computes[(info.compute, seed)] = lambda x, w=int4: m.int4_streaming_matmul(x, *w)
            self.compute[name] = computes[(info.compute, seed)]
        self.models = set(self.compute)
        self.app = self._build()

    def infer(self, model: str, body: bytes, header_length: str | None) -> Response:
        if model not in self.models:
            raise BadRequest(f"Request for unknown model: '{model}' is not found", 404)
        header, binary = _parse_request(body, header_length)
        info = catalog.model_info(model)
        inputs = header.get("inputs") or []
        if len(inputs) != 1 or inputs[0].get("name") != info.input.name:
            raise BadRequest(f"expected one input named {info.input.name}")
        if inputs[0].get("datatype") != info.input.datatype:
            raise BadRequest(
                f"input '{info.input.name}' data-type is '{inputs[0].get('datatype')}', "
                f"model expects '{info.input.datatype}'"
            )
        x, _ = _input_array(inputs[0], binary, 0)
        if x.ndim != 2 or x.shape[1] != self.dim or not 1 <= x.shape[0] <= info.max_batch_size:
            raise BadRequest(
                f"input '{info.input.name}' has shape {list(x.shape)}, model expects "
                f"[-1 (1..{info.max_batch_size}), {self.dim}]"
            )
        y = np.ascontiguousarray(self.compute[model](x), dtype=np.float32)
        params = header.get("parameters") or {}
        wanted = header.get("outputs") or [{"name": info.output.name}]
        binary_out = bool(params.get("binary_data_output")) or any(
            (o.get("parameters") or {}).get("binary_data") for o in wanted
        )
        out: dict = {"name": info.output.name, "datatype": "FP32", "shape": list(y.shape)}
        resp = {"model_name": model, "model_version": "1", "outputs": [out]}
        if "id" in header:
            resp["id"] = header["id"]
        if not binary_out:
            out["data"] = y.ravel().tolist()
            return JSONResponse(resp)
        raw = y.tobytes()
        out["parameters"] = {"binary_data_size": len(raw)}
        head = json.dumps(resp).encode()
        return Response(
            head + raw,
            media_type="application/octet-stream",
            headers={HEADER_LENGTH: str(len(head))},
        )

    def _build(self) -> FastAPI:
        app = FastAPI(title="inferwatch naive baseline", docs_url=None, redoc_url=None)

        @app.exception_handler(BadRequest)
        async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
            return JSONResponse({"error": str(exc)}, status_code=exc.status)

        @app.get("/healthz")
        @app.get("/v2/health/live")
        @app.get("/v2/health/ready")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/v2")
        async def server_metadata() -> dict:
            return {"name": "inferwatch-naive", "version": "1", "extensions": ["binary_tensor_data"]}

        @app.get("/v2/models/{model}")
        @app.get("/v2/models/{model}/versions/{version}")
        async def model_metadata(model: str, version: str = "1") -> dict:
            if model not in self.models:
                raise BadRequest(f"Request for unknown model: '{model}' is not found", 404)
            info = catalog.model_info(model)
            return {
                "name": model,
                "versions": ["1"],
                "platform": "python",
                "inputs": [
                    {"name": t.name, "datatype": t.datatype, "shape": [-1, *t.shape]} for t in info.inputs
                ],
                "outputs": [
                    {"name": t.name, "datatype": t.datatype, "shape": [-1, *t.shape]} for t in info.outputs
                ],
            }

        @app.get("/v2/models/{model}/ready")
        @app.get("/v2/models/{model}/versions/{version}/ready")
        async def model_ready(model: str, version: str = "1") -> Response:
            return Response(status_code=200 if model in self.models else 404)

        # async and computed inline: one request at a time, by design (the naive baseline).
        @app.post("/v2/models/{model}/infer")
        @app.post("/v2/models/{model}/versions/{version}/infer")
        async def infer(model: str, request: Request, version: str = "1") -> Response:
            return self.infer(model, await request.body(), request.headers.get(HEADER_LENGTH))

        return app


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, dim: int = catalog.DENSE_DIM) -> None:
    """Run until SIGTERM/Ctrl-C (uvicorn stops cleanly on both)."""
    import uvicorn

    logging.basicConfig(
        level=logging.INFO,
        format="ts=%(asctime)s level=%(levelname)s component=naive-server msg=%(message)r",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
    t = time.monotonic()
    server = NaiveServer(dim)
    log.info(
        "model loaded in %.1fs; serving %s on http://%s:%d",
        time.monotonic() - t,
        sorted(server.models),
        host,
        port,
    )
    # uvicorn stops gracefully on SIGTERM, then re-raises it to the handler it found: make that
    # a no-op so a requested stop exits 0 instead of dying by the signal.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(server.app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
    log.info("stopped")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (default: %(default)s)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reference_server.naive", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    serve(args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
