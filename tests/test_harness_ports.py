"""The test harness's local ports: servers bind theirs only when started, so none may be handed out twice."""

from __future__ import annotations

import socket

from harness.server import free_port


def test_free_port_hands_out_each_port_once_and_only_free_ones() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = int(listener.getsockname()[1])
        ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert taken not in ports
