"""Hostile local clients against a store server: stalls, restarts, timeouts, bad counts
and CLI errors.

See tests/store/hostile.py for how each attack is judged.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time

import pytest
import torch

import tidal.cli
import tidal.store
from tidal.store import StoreError, VolumeLostError, ops, testing
from tidal.store.cli import main as store_main

from .conftest import until
from .hostile import (
    SD,
    FakeVolume,
    W,
    acquire_raw,
    alive_volumes,
    begin_raw,
    healthy,
    read_key,
    serving,
)

# ------------------------------------------------------------- stalls, restarts, timeouts


def test_a_stopped_volume_does_not_stall_the_controller(victim, tmp_path):
    """A registered volume that stops answering (a stopped or hostile process): deleting its
    keys and everything else the controller does stay fast; its memory is freed once it
    answers again."""
    store, saved, base = victim
    stopped = FakeVolume(store, "stop", str(tmp_path))
    with tidal.store.connect(store.address, volume="stop") as w:
        w.put("on-stop", W)
    assert len(os.listdir(tmp_path)) == 1
    stopped.vol.go.clear()
    t0 = time.monotonic()
    assert store.delete("on-stop") == 1  # its destroy waits in the volume's queue
    with tidal.store.connect(store.address, volume="v0") as other:  # not the stopped one
        assert other.keys() == ["sd", "w"]
        other.put("meanwhile", W)
        other.delete("meanwhile")
    assert time.monotonic() - t0 < 10, "the controller waited for the stopped volume"
    assert stopped.vol.waiting.wait(10), "the destroy never reached the volume"
    stopped.vol.go.set()
    until(lambda: not os.listdir(tmp_path), "the destroyed segment stays")
    stopped.close()
    until(lambda: "stop" not in alive_volumes(store), "the volume that left stays listed")
    healthy(store, saved, base)


def test_a_handle_reconnects_after_the_server_restarts():
    """The server closes every connection (stopped, then restarted on the same port): the
    handle's next call goes out on a new connection; with nobody listening it says so."""
    with serving() as (first, _):
        port = int(first.address.rsplit(":", 1)[1])
        store = tidal.store.connect(first.address)
        store.put("x", W)
        store.put("x", W + 1)  # a reservation on the writer connection
    with serving(port=port) as (second, _):  # the same port, right away
        assert store.keys() == []  # a new store: the old one's data went with it
        assert store.put("x", W * 2) == 0
        assert torch.equal(store.get("x"), W * 2)
        assert store.put("x", W * 3) == 1
    with pytest.raises(StoreError, match="cannot reach tidal store.*stopped or restarted"):
        store.keys()
    store.close()


def test_a_handle_reconnects_after_a_timeout(victim, tmp_path):
    """A request that times out (its volume stopped) drops its connection; the handle's next
    call reconnects, and its leases and pending writes are not carried over."""
    store, saved, base = victim
    slow = FakeVolume(store, "slow", str(tmp_path))
    with tidal.store.connect(store.address, volume="slow", timeout=0.5) as h:
        slow.vol.go.clear()
        with pytest.raises(
            StoreError, match="did not answer 'put_begin' within 0.5 s; the next call reconnects"
        ):
            h.put("k", W)
        assert slow.vol.waiting.wait(10)
        assert h.keys() == ["sd", "w"]  # other connections were not affected
        slow.vol.go.set()
        assert h.put("k", W * 4) == 1  # version 0 went with the timed-out connection
        assert torch.equal(h.get("k"), W * 4)
        assert h.versions("k") == [1]
    slow.close()
    until(lambda: not alive_volumes(store).get("slow", False), "the volume stays alive")
    with pytest.raises(VolumeLostError, match="slow"):
        read_key(store, "k")
    store.delete("k")
    until(lambda: "slow" not in alive_volumes(store), "the dead volume stays listed")
    healthy(store, saved, base)


def test_a_bound_request_is_never_resent_on_a_new_connection(victim):
    """A lease or a pending write belongs to its connection: after the server dropped that
    connection, releasing or committing on a new one would be refused as someone else's,
    so the client says the connection was lost instead."""
    store, saved, base = victim
    conn = testing.raw(store.address)
    lease = acquire_raw(conn, "w")["lease"]
    _, begun = begin_raw(conn, store, "b", writer="w1")
    server_side = testing.leases(store)
    # The connection dies under the client's feet (as in a restart of the server).
    killer = socket.fromfd(conn.sock.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    killer.shutdown(socket.SHUT_RDWR)
    killer.close()
    until(lambda: testing.leases(store) < server_side, "the dropped connection kept its lease")
    with pytest.raises(StoreError, match="was lost before 'release'"):
        conn.request(ops.RELEASE, lease=lease)
    with pytest.raises(StoreError, match="was lost before 'put_commit'"):
        conn.request(ops.PUT_COMMIT, key="b", version=begun["version"], writer="w1", reserve=False)
    assert conn.request(ops.KEYS, prefix="")["keys"] == ["sd", "w"]  # unbound: reconnects
    conn.close()
    healthy(store, saved, base)


# ------------------------------------------------------------------------ the smaller items


def test_bad_counts_are_value_errors(victim):
    store, saved, base = victim
    for call in [
        lambda: store.put("w", W, version=-1),
        lambda: store.put("w", W, keep=0),
        lambda: store.put_state_dict(SD, "sd", version=-1),
        lambda: store.put_state_dict(SD, "sd", keep=0),
        lambda: store.get("w", version=-1),
        lambda: store.get_state_dict("sd", version=-1),
        lambda: store.exists("w", version=-1),
        lambda: store.delete("w", version=-1),
        lambda: tidal.store.connect(keep=0),
    ]:
        with pytest.raises(ValueError, match="version|keep") as e:
            call()
        assert not isinstance(e.value, StoreError), e.value  # not a ProtocolError
    healthy(store, saved, base)


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.put("w", W, version=1 << 63),
        lambda s: s.put("w", W, version=1 << 70),
        lambda s: s.get("w", version=1 << 63),
        lambda s: s.exists("w", version=1 << 70),
        lambda s: s.put("w", W, keep=1 << 21),
        lambda s: s.put("w", W, writers=1 << 21, version=5),
    ],
    ids=[
        "put version 2**63",
        "put version 2**70",
        "get version 2**63",
        "exists version 2**70",
        "keep 2**21",
        "writers 2**21",
    ],
)
def test_counts_past_the_wire_limits_are_value_errors(victim, call):
    store, saved, base = victim
    with pytest.raises(ValueError) as e:
        call(store)
    assert not isinstance(e.value, StoreError), e.value


def test_a_closed_handle_says_so():
    store = tidal.store.connect()
    store.put("w", W)
    store.close()
    store.close()  # twice is fine
    for call in [
        lambda: store.put("w", W),
        lambda: store.put_state_dict(SD, "sd"),
        lambda: store.get("w"),
        lambda: store.get_state_dict("sd"),
        lambda: store.keys(),
        lambda: store.versions("w"),
        lambda: store.exists("w"),
        lambda: store.delete("w"),
        lambda: store.ls(),
        lambda: store.put_async("w", W),
        lambda: store.get_async("w"),
    ]:
        with pytest.raises(StoreError, match=r"closed \(store\.close\(\) was called\)"):
            call()


def _busy_port() -> tuple[socket.socket, int]:
    sock = socket.create_server(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


def test_cli_errors_are_clear(capsys, tmp_path, monkeypatch):
    """``tidal store`` alone, a missing --shm-dir, a port in use, bad token files: a clear
    message and exit code, no traceback."""
    for run in (lambda: store_main([]), lambda: tidal.cli.main(["store"])):
        assert run() == 2
        err = capsys.readouterr().err
        assert "usage: tidal store" in err and "choose a command" in err
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
    try:
        assert store_main(["serve", "--shm-dir", str(tmp_path / "missing")]) == 2
        # serve lifts its soft fd limit first (each segment holds an fd): here, to the hard.
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] in (hard, 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    err = capsys.readouterr().err
    assert "does not exist or is not writable (--shm-dir)" in err and "Traceback" not in err
    busy, port = _busy_port()
    with busy:
        assert store_main(["serve", "--port", str(port), "--shm-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: address already in use" in err, err
    assert "Traceback" not in err and not os.listdir(tmp_path)
    monkeypatch.delenv("TIDAL_STORE_TOKEN", raising=False)
    monkeypatch.delenv("TIDAL_STORE", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    with serving(token="s3cret") as (server, _):
        with tidal.store.connect(server.address, token="s3cret") as s:
            s.put("tok", W)
        assert store_main(["ls", server.address, "--token-file", str(token_file)]) == 0
        assert "tok" in capsys.readouterr().out
        monkeypatch.setenv("TIDAL_STORE_TOKEN", "s3cret")
        monkeypatch.setenv("TIDAL_STORE", server.address)
        assert store_main(["ls"]) == 0
        assert "tok" in capsys.readouterr().out
        monkeypatch.setenv("TIDAL_STORE_TOKEN", "wrong")
        assert store_main(["ls"]) == 1
        assert "wrong or missing token" in capsys.readouterr().err
        (tmp_path / "empty").write_text("\n")
        assert store_main(["ls", "--token-file", str(tmp_path / "empty")]) == 2
        assert "is empty" in capsys.readouterr().err
        assert store_main(["ls", "--token-file", str(tmp_path / "nope")]) == 2
        assert "cannot read --token-file" in capsys.readouterr().err


def test_ls_into_head_ends_quietly():
    """``tidal store ls | head -1`` through a shell pipe: head leaves early, ls exits 0
    without a BrokenPipeError (the listing is larger than a pipe's buffer). The token comes
    from the environment."""
    with serving(token="s3cret") as (server, _):
        with tidal.store.connect(server.address, token="s3cret") as s:
            for i in range(100):
                s.put(f"{i:03d}/" + "k" * 1000, torch.ones(1))
        env = {**os.environ, "TIDAL_STORE_TOKEN": "s3cret", "TIDAL_STORE": server.address}
        out = subprocess.run(
            ["bash", "-o", "pipefail", "-c", f"{sys.executable} -m tidal.store ls | head -1"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("KEY") and out.stdout.count("\n") == 1
    assert "BrokenPipe" not in out.stderr and "Traceback" not in out.stderr, out.stderr
