"""A tiny Docker Engine API client over the daemon's unix socket (stdlib only)."""

from __future__ import annotations

import http.client
import json
import socket
import struct
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode


class DockerError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"docker API {status}: {message}")
        self.status = status
        self.message = message


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


class Docker:
    """Only what the kubelet needs: images, containers, logs. One connection per call."""

    def __init__(self, host: str) -> None:
        if not host.startswith("unix://"):
            raise ValueError(f"only unix:// docker hosts are supported, got {host!r}")
        self.host = host
        self.path = host[len("unix://"):]

    def _open(self, method: str, url: str, body: Any = None, timeout: float | None = 30
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = _UnixConnection(self.path, timeout)
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, url, body=data, headers=headers)
        resp = conn.getresponse()
        if resp.status >= 400:
            raw = resp.read()
            conn.close()
            try:
                msg = json.loads(raw).get("message", raw.decode(errors="replace"))
            except ValueError:
                msg = raw.decode(errors="replace")
            raise DockerError(resp.status, msg)
        return conn, resp

    def call(self, method: str, url: str, body: Any = None, timeout: float | None = 30) -> Any:
        conn, resp = self._open(method, url, body, timeout)
        try:
            raw = resp.read()
        finally:
            conn.close()
        return json.loads(raw) if raw and resp.headers.get_content_type() == "application/json" else None

    def ping(self) -> bool:
        try:
            self._open("GET", "/_ping", timeout=3)[0].close()
            return True
        except (OSError, DockerError):
            return False

    def image_exists(self, image: str) -> bool:
        try:
            self.call("GET", f"/images/{quote(image, safe='')}/json")
            return True
        except DockerError as e:
            if e.status == 404:
                return False
            raise

    def images(self) -> list[str]:
        return sorted(t for i in self.call("GET", "/images/json") for t in i.get("RepoTags") or [])

    def image_id(self, image: str) -> str:
        return self.call("GET", f"/images/{quote(image, safe='')}/json")["Id"]

    def create(self, name: str, config: dict[str, Any]) -> str:
        return self.call("POST", "/containers/create?" + urlencode({"name": name}), config)["Id"]

    def start(self, cid: str) -> None:
        self.call("POST", f"/containers/{cid}/start", timeout=120)

    def inspect(self, cid: str) -> dict[str, Any]:
        return self.call("GET", f"/containers/{cid}/json")

    def list(self, label: str) -> list[dict[str, Any]]:
        filters = json.dumps({"label": [label]})
        return self.call("GET", "/containers/json?" + urlencode({"all": "1", "filters": filters}))

    def kill(self, cid: str, signal: str = "SIGKILL") -> None:
        try:
            self.call("POST", f"/containers/{cid}/kill?signal={signal}")
        except DockerError as e:
            if e.status not in (404, 409):  # gone, or not running
                raise

    def remove(self, cid: str) -> None:
        try:
            self.call("DELETE", f"/containers/{cid}?force=1&v=1")
        except DockerError as e:
            if e.status not in (404, 409):  # gone, or its removal is already under way
                raise

    def logs(self, cid: str, *, follow: bool = False, tail: int | None = None,
             timestamps: bool = False, since: int | None = None) -> Iterator[bytes]:
        """Yield the container's stdout+stderr as bytes chunks (demultiplexed)."""
        q = {"stdout": "1", "stderr": "1", "follow": "1" if follow else "0",
             "timestamps": "1" if timestamps else "0", "tail": "all" if tail is None else str(tail)}
        if since:
            q["since"] = str(since)
        conn, resp = self._open("GET", f"/containers/{cid}/logs?" + urlencode(q),
                                timeout=None if follow else 60)
        try:
            tty = resp.headers.get("Content-Type") == "application/vnd.docker.raw-stream"
            while True:
                if tty:
                    chunk = resp.read1(65536)
                    if not chunk:
                        return
                    yield chunk
                    continue
                head = resp.read(8)
                if len(head) < 8:
                    return
                size = struct.unpack(">I", head[4:])[0]
                yield resp.read(size)
        finally:
            conn.close()
