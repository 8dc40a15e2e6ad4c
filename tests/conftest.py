"""Fixtures live in tests/fixtures/, one module per component, so each can be read alone."""

pytest_plugins = [
    "tests.fixtures.net",
    "tests.fixtures.gpu_exporter",
    "tests.fixtures.triton",
    "tests.fixtures.sidecar",
    "tests.fixtures.deploy",
    "tests.fixtures.alerting",
    "tests.fixtures.stack",
]
