"""The nginx the benchmarks measure the sidecar against: one worker, a plain reverse proxy with
keep-alive to the upstream (what a team would put there otherwise), written into its own folder.

Used by ``sidecar_overhead.py`` (small JSON inferences) and ``llm_streams.py`` (token streams:
unbuffered, as a streaming proxy must be, with a read timeout above a long generation's).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

_CONF = """
{user}
daemon off;
master_process on;
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream backend {{
        server {upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
{server}        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
{location}        }}
    }}
}}
"""


def binary() -> str | None:
    """nginx's path, None when it is not installed (Debian puts it in /usr/sbin)."""
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def write_conf(
    folder: Path, upstream: str, port: int, *, max_body: str | None = None, streaming: bool = False
) -> Path:
    """Write ``folder/nginx.conf`` proxying 127.0.0.1:``port`` to ``upstream`` (host:port).
    ``max_body``: client_max_body_size (None: nginx's 1m); ``streaming``: answers are passed on
    as they arrive (proxy_buffering off) and may take up to 300 s."""
    server = f"        client_max_body_size {max_body};\n" if max_body else ""
    location = "            proxy_buffering off;\n            proxy_read_timeout 300s;\n" if streaming else ""
    conf = folder / "nginx.conf"
    conf.write_text(
        _CONF.format(
            user="user root;" if os.geteuid() == 0 else "",
            dir=folder,
            upstream=upstream,
            port=port,
            server=server,
            location=location,
        )
    )
    return conf
