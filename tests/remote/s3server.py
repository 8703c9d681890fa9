"""A real S3 server for the remote tier's tests: moto's server (``python -m moto.server``) on 127.0.0.1 on a free
port, started here as a subprocess, as s3fs's own test suite does. No mock of the client library: s3fs talks HTTP to
it. The tests skip, saying why, where s3fs or moto's server is not installed (``bash scripts/setup.sh`` installs
both)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import pytest

MISSING = [m for m in ("s3fs", "moto", "flask") if importlib.util.find_spec(m) is None]
START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class S3Server:
    proc: subprocess.Popen[bytes]
    endpoint: str

    def new_bucket(self) -> str:
        """A fresh, empty bucket; returns its name."""
        import s3fs

        name = f"lowdiff-{uuid.uuid4().hex[:12]}"
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(name)
        return name

    def fs(self):  # an s3fs filesystem on this server, for the tests' own looks at the bucket
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True)


def start_server() -> S3Server:
    if MISSING:
        pytest.skip(f"the remote tier's tests need {', '.join(MISSING)}: pip install 'lowdiff[remote,test]' "
                    "(bash scripts/setup.sh installs them)")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto's S3 server did not start on {endpoint} within {START_TIMEOUT_S} s") from None
            time.sleep(0.2)
    return S3Server(proc, endpoint)


def stop_server(server: S3Server) -> None:
    server.proc.kill()
    server.proc.wait(timeout=30)


class _Relay:
    """A TCP relay in front of an S3 endpoint (``endpoint``: where to point a client instead), each connection pumped
    both ways on threads of its own; the subclasses say what passes."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit("//", 1)[1].rsplit(":", 1)
        self._target = (host, int(port))
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._server.close()
        for c in self._conns:
            c.close()

    def _admit(self) -> bool:
        return True

    def _hold(self, data: bytes) -> None:
        """Called with each chunk sent to the store before it is passed on."""

    def _accept(self) -> None:
        while True:
            try:
                client = self._server.accept()[0]
            except OSError:
                return
            if not self._admit():
                client.close()  # refused: the client sees the connection end before any answer
                continue
            upstream = socket.create_connection(self._target)
            self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, to_store: bool) -> None:
        try:
            while data := src.recv(65536):
                if to_store:
                    self._hold(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class HeldUploads(_Relay):
    """Holds back every upload (an HTTP ``PUT``) until :meth:`release`: the request stays in flight, unseen by the
    store, as a slow network would leave it; everything else passes at once. ``held`` is set once the first upload
    is held."""

    def __init__(self, target: str) -> None:
        self.held = threading.Event()
        self._released = threading.Event()
        super().__init__(target)

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._released.set()
        super().close()

    def _hold(self, data: bytes) -> None:
        if b"PUT /" in data and not self._released.is_set():
            self.held.set()
            self._released.wait()


class Outage(_Relay):
    """A store that does not answer while :attr:`up` is clear (every connection is closed at once), and answers
    once it is set."""

    def __init__(self, target: str) -> None:
        self.up = threading.Event()
        super().__init__(target)

    def _admit(self) -> bool:
        return self.up.is_set()



class OnRequest(_Relay):
    """Runs ``action()`` once, before the store sees it, when a request whose start holds every one of ``match``
    (bytes: a method, an object's name) goes through; ``fired`` is set then."""

    def __init__(self, target: str, match: tuple[bytes, ...], action: Callable[[], object]) -> None:
        self.fired = threading.Event()
        self._match, self._action = match, action
        self._lock = threading.Lock()
        super().__init__(target)

    def _hold(self, data: bytes) -> None:
        with self._lock:
            if not self.fired.is_set() and all(m in data for m in self._match):
                self._action()
                self.fired.set()


RelayT = TypeVar("RelayT", bound=_Relay)


@contextmanager
def relayed(relay: RelayT) -> Iterator[RelayT]:
    """``relay`` (one of the relays above, made with a server's ``endpoint``), closed afterwards."""
    try:
        yield relay
    finally:
        relay.close()
