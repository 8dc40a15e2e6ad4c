"""The HTTP proxy's parsing, fed raw bytes: model and version from the URL, custom routes,
status lines and the fixed error answers."""

from __future__ import annotations

import re

import pytest

from sidecar.config import Route
from sidecar.protocols.http1 import ERROR_RESPONSES, OVERLOAD_RESPONSE, STATUS_LINE, labels_from_path


@pytest.mark.parametrize(
    ("path", "model", "version"),
    [
        (b"/v2/models/ranker/infer", "ranker", ""),
        (b"/v2/models/ranker/versions/2/infer", "ranker", "2"),
        (b"/v2/models/ranker", "ranker", ""),
        (b"/v2/models/ranker/ready", "ranker", ""),
        (b"/v2/models/ranker/versions/1", "ranker", "1"),
        (b"/v2/models/ranker/config", "ranker", ""),
        (b"/v2/models/my%20model/infer", "my model", ""),
        (b"/v2/models/dense.v3-b_1/versions/10/infer", "dense.v3-b_1", "10"),
        (b"/v2/models/stats", "", ""),
        (b"/v2/models/ranker/stats", "ranker", ""),
        (b"/v2/models/", "", ""),
        (b"/v2/health/ready", "", ""),
        (b"/v2", "", ""),
        (b"/", "", ""),
        (b"/v2/repository/index", "", ""),
        (b"/v2/models/\xff\xfe/infer", "\ufffd\ufffd", ""),
    ],
)
def test_kserve_paths(path: bytes, model: str, version: str) -> None:
    got_model, got_version, _route = labels_from_path(path)
    assert (got_model, got_version) == (model, version)


def test_route_template_hides_names() -> None:
    assert (
        labels_from_path(b"/v2/models/ranker/versions/2/infer")[2]
        == "/v2/models/{model}/versions/{version}/infer"
    )
    assert labels_from_path(b"/v2/models/ranker/infer")[2] == "/v2/models/{model}/infer"


def test_custom_routes() -> None:
    routes = (
        Route(re.compile(r"^/v1/models/(?P<model>[^/:]+)(?:/versions/(?P<version>\d+))?:predict$")),
        Route(re.compile(r"^/predict/(?P<model>\w+)")),
    )
    assert labels_from_path(b"/v1/models/bert:predict", routes)[:2] == ("bert", "")
    assert labels_from_path(b"/v1/models/bert/versions/3:predict", routes)[:2] == ("bert", "3")
    assert labels_from_path(b"/predict/resnet/extra", routes)[:2] == ("resnet", "")
    assert labels_from_path(b"/other", routes)[:2] == ("", "")
    # KServe v2 paths are recognised before custom routes.
    assert labels_from_path(b"/v2/models/x/infer", routes)[:2] == ("x", "")


def test_status_lines_and_fixed_answers() -> None:
    assert STATUS_LINE["1.1"][200] == b"HTTP/1.1 200 OK\r\n"
    assert STATUS_LINE["1.0"][404] == b"HTTP/1.0 404 Not Found\r\n"
    assert STATUS_LINE["1.1"][599].startswith(b"HTTP/1.1 599 ")
    for (status, close), raw in ERROR_RESPONSES.items():
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % status)
        assert b"content-length: %d" % len(body) in head
        assert (b"connection: close" in head) is close
    head, _, body = OVERLOAD_RESPONSE.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head and b"overloaded" in body
