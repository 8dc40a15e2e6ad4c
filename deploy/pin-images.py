#!/usr/bin/env python3
"""Pins every image inferwatch deploys to its digest, beside its tag (`name:tag@sha256:...`).

    python deploy/pin-images.py            # resolve each tag, rewrite the files
    python deploy/pin-images.py --check    # only report: exit 1 if a digest is missing or stale
    python deploy/pin-images.py --image registry.example.com/inferwatch:0.1.0   # after a push

Where it looks: `image:` lines in docker-compose.yml and deploy/kubernetes, `FROM` lines in
deploy/docker/Dockerfile, and the `images:` entries of the overlays' kustomization.yaml
(newName/newTag, to which it adds `digest:`; kustomize then writes `name:tag@digest`).
The inferwatch image itself is skipped where it is only a local build or a placeholder the
overlays rename (`inferwatch:<version>` without a registry).

How: the registry's HTTP API (the OCI distribution spec). It asks for the manifest of the
tag with HEAD, accepting an image index first, so the digest is the multi-architecture one
every platform pulls, and follows the registry's anonymous bearer-token challenge. Private
registries: put a token in $REGISTRY_TOKEN. Standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACCEPT = ", ".join(
    [
        "application/vnd.oci.image.index.v1+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.docker.distribution.manifest.v2+json",
    ]
)
DIGEST = r"sha256:[0-9a-f]{64}"
# name[:tag][@digest] as it appears after `image:` or `FROM`.
REF = re.compile(rf"(?P<name>[a-z0-9][\w./-]*?)(?::(?P<tag>[\w][\w.-]{{0,127}}))?(?:@(?P<digest>{DIGEST}))?")
LINE = re.compile(
    r"^(?P<head>\s*(?:-\s*)?image:\s*|FROM\s+)(?P<q>[\"']?)(?P<ref>\S+?)(?P=q)(?P<tail>(?:\s+AS\s+\S+)?\s*(?:#.*)?)$"
)

Resolver = Callable[[str, str], str]


class PinError(Exception):
    """One line saying which image could not be resolved, and why."""


def split_name(name: str) -> tuple[str, str]:
    """(registry host, repository) as a client resolves them: docker.io and library/ by default."""
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        host, repo = first, rest
    else:
        host, repo = "registry-1.docker.io", name
    if host == "registry-1.docker.io" and "/" not in repo:
        repo = f"library/{repo}"
    return host, repo


def _request(url: str, method: str, headers: dict[str, str]) -> urllib.response.addinfourl:
    return urllib.request.urlopen(urllib.request.Request(url, method=method, headers=headers), timeout=30)


def _token(challenge: str, repo: str) -> str:
    """The anonymous (or $REGISTRY_TOKEN-authorized) bearer token a 401 challenge asks for."""
    params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    if not challenge.lower().startswith("bearer") or "realm" not in params:
        raise PinError(f"unsupported authentication challenge: {challenge}")
    query = {"service": params.get("service", ""), "scope": params.get("scope", f"repository:{repo}:pull")}
    headers = {}
    if os.environ.get("REGISTRY_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['REGISTRY_TOKEN']}"
    with _request(f"{params['realm']}?{urllib.parse.urlencode(query)}", "GET", headers) as resp:
        body = json.load(resp)
    return body.get("token") or body["access_token"]


def registry_digest(name: str, tag: str, scheme: str | None = None) -> str:
    """The digest the registry serves for name:tag (the index's, for multi-platform images).
    Plain HTTP for a registry on loopback, as Docker does; HTTPS everywhere else."""
    host, repo = split_name(name)
    if scheme is None:
        scheme = "http" if host.split(":")[0] in ("localhost", "127.0.0.1", "[::1]") else "https"
    url = f"{scheme}://{host}/v2/{repo}/manifests/{tag}"
    headers = {"Accept": ACCEPT}
    try:
        for method in ("HEAD", "GET"):
            try:
                resp = _request(url, method, headers)
            except urllib.error.HTTPError as exc:
                if exc.code != 401 or "Authorization" in headers:
                    raise
                headers["Authorization"] = f"Bearer {_token(exc.headers.get('WWW-Authenticate', ''), repo)}"
                resp = _request(url, method, headers)
            with resp:
                digest = resp.headers.get("Docker-Content-Digest")
                if digest:
                    return digest
                if method == "GET":
                    return "sha256:" + hashlib.sha256(resp.read()).hexdigest()
    except urllib.error.HTTPError as exc:
        raise PinError(f"{name}:{tag}: {host} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise PinError(f"{name}:{tag}: cannot reach {host}: {getattr(exc, 'reason', exc)}") from None
    raise PinError(f"{name}:{tag}: {host} gave no digest")


def is_local(name: str) -> bool:
    """inferwatch's own image before the overlays rename it: a build, not a pull."""
    return name == "inferwatch"


def files(root: Path) -> list[Path]:
    found = [root / "docker-compose.yml", root / "deploy" / "docker" / "Dockerfile"]
    found += sorted((root / "deploy" / "kubernetes").rglob("*.yaml"))
    return [p for p in found if p.is_file()]


def pin_text(text: str, resolve: Resolver, report: list[str], where: str) -> str:
    """``text`` with every pullable image line pinned; what changed or is missing goes to ``report``."""
    lines = text.splitlines(keepends=True)
    out = []
    entry: dict[str, int | str] = {}  # the kustomization `images:` entry being read
    for i, line in enumerate(lines):
        body = line.rstrip("\n")
        if m := LINE.match(body):
            ref = REF.fullmatch(m["ref"])
            if ref and ref["tag"] and not is_local(ref["name"]) and "$" not in m["ref"]:
                digest = _resolve(resolve, ref["name"], ref["tag"], report, f"{where}:{i + 1}")
                if digest and digest != ref["digest"]:
                    report.append(f"{where}:{i + 1}: {ref['name']}:{ref['tag']} -> {digest}")
                    body = f"{m['head']}{m['q']}{ref['name']}:{ref['tag']}@{digest}{m['q']}{m['tail']}"
        out.append(body + ("\n" if line.endswith("\n") else ""))
        # kustomization images: - name / newName / newTag / digest, in any order.
        if km := re.match(r"^(\s*)(-\s+)?(name|newName|newTag|digest):\s*\"?([^\"\s#]+)\"?", body):
            indent = len(km[1]) + len(km[2] or "")
            if km[2]:
                entry = {"indent": indent}
            if entry.get("indent") == indent:
                entry[km[3]] = km[4]
                entry.setdefault("last", len(out) - 1)
                entry["last"] = len(out) - 1
                if km[3] == "digest":
                    entry["digest_at"] = len(out) - 1
                _pin_entry(entry, out, resolve, report, f"{where}:{i + 1}", lines, i)
    return "".join(out)


def _pin_entry(
    entry: dict, out: list[str], resolve: Resolver, report: list[str], where: str, lines, i
) -> None:
    """Adds or updates `digest:` once the entry's last key has been read."""
    nxt = lines[i + 1] if i + 1 < len(lines) else ""
    m = re.match(r"^(\s*)(-\s+)?\w+:", nxt)
    if m and len(m[1]) == entry["indent"] and not m[2]:
        return  # the entry goes on
    if "newTag" not in entry or entry.get("done"):
        return
    entry["done"] = True
    name = str(entry.get("newName", entry.get("name")))
    digest = _resolve(resolve, name, str(entry["newTag"]), report, where)
    if not digest or digest == entry.get("digest"):
        return
    report.append(f"{where}: {name}:{entry['newTag']} -> {digest}")
    line = " " * entry["indent"] + f"digest: {digest}\n"
    if "digest_at" in entry:
        out[entry["digest_at"]] = line
    else:
        out.insert(entry["last"] + 1, line)


def _resolve(resolve: Resolver, name: str, tag: str, report: list[str], where: str) -> str | None:
    try:
        return resolve(name, tag)
    except PinError as exc:
        report.append(f"{where}: cannot pin: {exc}")
        return None


def main(argv: list[str] | None = None, resolve: Resolver = registry_digest, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(
        description="Pin inferwatch's images to their digests, beside their tags."
    )
    parser.add_argument("--check", action="store_true", help="only report; exit 1 if anything would change")
    parser.add_argument("--image", action="append", default=[], help="only these name:tag references")
    args = parser.parse_args(argv)
    if args.image:
        wanted = set(args.image)
        inner = resolve

        def resolve(name: str, tag: str) -> str:
            if f"{name}:{tag}" not in wanted:
                raise PinError(f"{name}:{tag}: not asked for (--image)")
            return inner(name, tag)

    changes = errors = 0
    for path in files(root):
        text = path.read_text(encoding="utf-8")
        report: list[str] = []
        new = pin_text(text, resolve, report, str(path.relative_to(root)))
        for line in report:
            if args.image and "not asked for" in line:
                continue
            print(line)
            if "cannot pin" in line:
                errors += 1
            else:
                changes += 1
        if new != text and not args.check:
            path.write_text(new, encoding="utf-8")
    if errors:
        print(
            f"pin-images: {errors} image(s) could not be resolved; their lines are unchanged", file=sys.stderr
        )
    return 1 if errors or (args.check and changes) else 0


if __name__ == "__main__":
    sys.exit(main())
