"""lmrepo.distributed.launch.free_port: a rendezvous port no other process can take between the pick and rank
0's bind (the kernel's own picks, port 0 and every connection's local port, come from another
range; other lmrepo processes respect the claim)."""

import os
import socket
import subprocess
import tempfile
import time

import pytest

from harness import PYTHON, REPO
from lmrepo.distributed import launch


@pytest.fixture
def claims_in(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"lmrepo-ports-{os.getuid()}"


def test_the_port_lies_outside_the_kernels_own_range_and_is_free(claims_in):
    low, high = launch.ephemeral_ports()
    for _ in range(20):
        port = launch.free_port()
        assert not low <= port <= high
        with socket.socket() as s:
            s.bind(("", port))  # nothing listens there
        assert (claims_in / str(port)).exists()


def test_a_claimed_port_is_not_handed_out_again_until_its_claim_expires(claims_in, monkeypatch):
    ports = range(launch.rendezvous_ports().start, launch.rendezvous_ports().start + 3)
    monkeypatch.setattr(launch, "rendezvous_ports", lambda: ports)
    taken = {launch.free_port() for _ in range(3)}
    assert taken == set(ports)
    assert launch.free_port() not in ports  # all claimed: the kernel's pick is the last resort
    old = claims_in / str(ports[1])
    os.utime(old, (time.time() - launch.PORT_CLAIM_S - 1,) * 2)
    assert launch.free_port() == ports[1]


def test_a_port_something_listens_on_is_skipped(claims_in, monkeypatch):
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        monkeypatch.setattr(launch, "rendezvous_ports", lambda: range(busy, busy + 1))
        assert launch.free_port() != busy


def test_processes_picking_side_by_side_never_share_a_port(tmp_path):
    """Four processes, 100 picks each at once, in a stretch of 1,000 ports: no port twice."""
    code = (
        "import tempfile, sys; tempfile.tempdir = sys.argv[1]\n"
        "from lmrepo.distributed import launch\n"
        "launch.rendezvous_ports = lambda: range(21000, 22000)\n"
        "print(*(launch.free_port() for _ in range(100)))"
    )
    procs = [
        subprocess.Popen([PYTHON, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO)
        for _ in range(4)
    ]
    picks = [int(p) for proc in procs for p in proc.communicate(timeout=120)[0].split()]
    assert len(picks) == 400 and len(set(picks)) == 400
