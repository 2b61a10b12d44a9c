"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

    with netns_pair() as net:                # or the pytest fixture `two_hosts`
        proc = net.run(net.a, [sys.executable, "-m", "some.module"], env={"UCX_TLS": "tcp"})
        ...                                  # net.a.address talks to net.b.address over the veth
        net.link_down()                      # both ends of the veth down: the link is cut
        net.link_up()

Namespaces are named `m2n-<random>-a` / `-b`, the veth ends `m2n<random>a` / `b`, the
addresses are 10.213.<x>.1 and .2 of a /30 with a random <x>: they exist only inside the
two namespaces, so they cannot clash with the host's. Everything is torn down on exit,
also when the body fails: the processes started with `run` are killed (their process
groups), then the namespaces are deleted, which deletes the veth with them.

Needs root and a working `ip netns`; otherwise `netns_pair` skips the test, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Iterator

import pytest

IP_TIMEOUT_S = 10.0  # any single `ip` command


@dataclass(frozen=True)
class Host:
    """One side: its namespace, its address on the veth and the veth end's name."""

    netns: str
    address: str
    device: str


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def namespaces() -> set[str]:
    """The names `ip netns list` shows now."""
    return {line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()}


@dataclass
class TwoHosts:
    a: Host
    b: Host
    processes: list[subprocess.Popen] = field(default_factory=list)

    def run(self, host: Host, argv: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """Start `argv` inside `host`'s namespace (`ip netns exec`, which execs it: the Popen is
        the program itself) in its own process group; `env` is added to this environment."""
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], env=full_env, start_new_session=True,
                                **popen)
        self.processes.append(proc)
        return proc

    def link_down(self) -> None:
        """Cut the link: both veth ends down (no carrier, no route between the two)."""
        for host in (self.a, self.b):
            ip("-n", host.netns, "link", "set", host.device, "down")

    def link_up(self, timeout: float = 5.0) -> None:
        """Both veth ends up; returns once both have a carrier (see `wait_running`)."""
        for host in (self.a, self.b):
            ip("-n", host.netns, "link", "set", host.device, "up")
        self.wait_running(timeout)

    def wait_running(self, timeout: float = 5.0) -> None:
        """Waits until both veth ends are operationally up. The kernel reports a new carrier
        with a delay (linkwatch, up to a second), and programs that look for running
        interfaces meanwhile miss the veth: UCX then says the device "is not available"."""
        deadline = time.monotonic() + timeout
        for host in (self.a, self.b):
            while "state UP" not in ip("-n", host.netns, "-o", "link", "show", "dev", host.device).stdout:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"{host.device} in {host.netns} is not up after {timeout:g} s: "
                                       f"{ip('-n', host.netns, '-o', 'link', 'show', 'dev', host.device).stdout}")
                time.sleep(0.02)

    def bytes_sent(self, host: Host) -> int:
        """Bytes `host`'s veth end has transmitted: what crossed the link from that side."""
        out = ip("-n", host.netns, "-j", "-s", "link", "show", "dev", host.device).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def kill_all(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    return None


@contextlib.contextmanager
def netns_pair() -> Iterator[TwoHosts]:
    """Two namespaces joined by a veth, up and addressed; everything removed on exit."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    token, subnet = secrets.token_hex(3), f"10.213.{secrets.randbelow(256)}"
    net = TwoHosts(a=Host(f"m2n-{token}-a", f"{subnet}.1", f"m2n{token}a"),
                   b=Host(f"m2n-{token}-b", f"{subnet}.2", f"m2n{token}b"))
    made: list[str] = []
    try:
        try:
            for host in (net.a, net.b):
                ip("netns", "add", host.netns)
                made.append(host.netns)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            pytest.skip(f"cannot create network namespaces here: {exc}")
        ip("link", "add", net.a.device, "netns", net.a.netns, "type", "veth", "peer", "name", net.b.device,
           "netns", net.b.netns)
        for host in (net.a, net.b):
            ip("-n", host.netns, "addr", "add", f"{host.address}/30", "dev", host.device)
            ip("-n", host.netns, "link", "set", "lo", "up")
            ip("-n", host.netns, "link", "set", host.device, "up")
        net.wait_running()
        yield net
    finally:
        net.kill_all()
        for name in made:  # what escaped its process group (daemons such as Ray's) goes with its namespace
            pids = ip("netns", "pids", name, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        for name in made:
            ip("netns", "del", name, check=False)
        left = set(made) & namespaces()
        if left:
            raise RuntimeError(f"network namespaces {sorted(left)} survived their deletion")


@pytest.fixture
def two_hosts() -> Iterator[TwoHosts]:
    """`netns_pair` as a pytest fixture (import it into the test module that uses it)."""
    with netns_pair() as net:
        yield net
