"""free_port and free_port_range: drawn below the ephemeral range, at random, every port of a range bindable."""

import random
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


def test_free_ports_are_drawn_below_the_ephemeral_range_and_not_alike():
    from entr_megatron.utils import spawn

    low, _ = spawn._ephemeral_range()
    ports = [spawn.free_port() for _ in range(50)]
    assert all(spawn.LISTEN_PORTS_LOW <= p < low for p in ports), ports
    assert len(set(ports)) >= 45  # random draws over ~22,000 ports (a seeded or fixed pick repeats)
    random.seed(0)
    first = spawn.free_port()
    random.seed(0)  # the global RNG (seeded by runs) does not decide the pick
    assert len({first, spawn.free_port(), spawn.free_port()}) > 1


def test_a_taken_port_is_never_returned(monkeypatch):
    from entr_megatron.utils import spawn

    # Two consecutive ports free a moment ago, drawn below the ephemeral range: a port the kernel
    # hands out (bind to 0) can have a neighbour another job holds, and then no port is free here.
    taken = free_port_range(2)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", taken))
        monkeypatch.setattr(spawn, "LISTEN_PORTS_LOW", taken)
        monkeypatch.setattr(spawn, "_ephemeral_range", lambda: (taken + 2, 60999))
        assert {spawn.free_port() for _ in range(20)} == {taken + 1}  # the only free one of [taken, taken + 1]
