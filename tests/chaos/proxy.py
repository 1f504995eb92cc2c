"""A TCP relay the nemesis can cut: a silent partition on loopback, without privileges.

Cut, it relays nothing and closes nothing: both peers keep an open connection on which no byte
arrives and no FIN or RST ever comes, as when a switch or a firewall drops a host's packets (what
keepalives and deadlines are for). Healed, it relays what it held back, in order: TCP would
deliver the retransmitted bytes the same way. A connection the target closes or refuses is
closed on the other side too (a restarted target is reached again by the next connection).
``delay`` holds every chunk that long before relaying it: a link's latency each way. ``drop``
closes the connections relayed so far; ``close_new(n)`` accepts the next ``n`` connections and
closes them at once, before the handshake.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Proxy:
    def __init__(self, target: str, delay: float = 0.0) -> None:
        host, port = target.rsplit(":", 1)
        self.delay = delay
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._close_new = 0  # connections to accept and close at once
        self.closed_at_once = 0  # ... and how many were
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True, name=f"proxy-{self.address}").start()

    @property
    def cut_off(self) -> bool:
        return not self._flowing.is_set()

    def cut(self) -> None:
        self._flowing.clear()

    def heal(self) -> None:
        self._flowing.set()

    def drop(self) -> None:
        """Close every connection relayed so far (new ones are relayed): as a peer that gave up on
        a connection (a server whose keep-alive ping went unanswered) or restarted."""
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            self._close(sock)

    def close_new(self, count: int) -> None:
        """Accept the next ``count`` connections and close them at once: a peer (or a middlebox)
        that takes the connection and drops it before the client's handshake is done."""
        with self._lock:
            self._close_new = count

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(conn,), daemon=True).start()

    def _connect(self, conn: socket.socket) -> None:
        with self._lock:
            closing, self._close_new = self._close_new > 0, max(0, self._close_new - 1)
        if closing:
            self._close(conn)
            with self._lock:
                self.closed_at_once += 1
            return
        self._track(conn)
        self._flowing.wait()  # a connection made across the cut waits, unanswered, for the heal
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            self._close(conn)
            return
        upstream.settimeout(None)
        self._track(upstream)
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if self.delay:
                    time.sleep(self.delay)
                self._flowing.wait()
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
        except OSError:
            self._close(src)
            self._close(dst)

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)

    def _close(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with contextlib.suppress(OSError):
            # A close alone neither wakes a pump blocked in recv() on the socket nor sends the FIN
            # until that recv returns: the peer would keep a silent connection, not a closed one.
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.drop()
