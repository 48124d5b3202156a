"""free_port_range: every port of the range can be bound (one group per pipeline stage)."""

import socket

from entr_megatron.utils.spawn import free_port_range


def test_consecutive_ports_are_all_bindable():
    for count in (1, 2, 4):
        base = free_port_range(count)
        sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
        try:
            for s, port in zip(sockets, range(base, base + count)):
                s.bind(("127.0.0.1", port))  # raises if the range was not free
        finally:
            for s in sockets:
                s.close()
