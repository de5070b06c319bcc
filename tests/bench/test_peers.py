"""The peers a comparison starts itself (``cadence/bench/peers.py``) and the server process that runs
them (``cadence.api.testing.HTTPServerProcess``), against a stand-in server: an executable that
records its command line and answers ``/health`` only after a delay, as a server loading its model."""

from __future__ import annotations

import errno
import json
import socket
import stat
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from cadence.api.testing import HTTPServerProcess
from cadence.bench import peers
from cadence.bench.peers import VLLM_ENV, find_preloads, llama_server_peer, preloads_or_exit, vllm_peer

_LOADING_S = 0.5

_STAND_IN = textwrap.dedent(f"""\
    #!{sys.executable}
    import http.server, json, sys, time
    from pathlib import Path
    Path(sys.argv[0] + ".argv").write_text(json.dumps(sys.argv[1:]))
    port = int(sys.argv[sys.argv.index("--port") + 1])
    ready_at = time.monotonic() + {_LOADING_S}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status = 200 if time.monotonic() >= ready_at else 503  # llama-server says 503 while loading
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"{{}}")

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    path = tmp_path / "server"
    path.write_text(_STAND_IN)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _argv(stand_in: Path) -> list[str]:
    argv: list[str] = json.loads(Path(f"{stand_in}.argv").read_text())
    return argv


def test_a_server_is_ready_once_its_health_says_200_and_is_stopped_on_leaving(stand_in: Path, tmp_path: Path) -> None:
    server = HTTPServerProcess(lambda port: [str(stand_in), "--port", str(port)], log_path=tmp_path / "log")
    with server:
        assert server.ready_after_s is not None and server.ready_after_s >= _LOADING_S
        with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
            assert response.status == 200
        assert server.process is not None and server.process.poll() is None
    assert server.process.poll() is not None
    assert server.health() is None


def test_its_port_is_no_one_else_s_while_it_starts(stand_in: Path, tmp_path: Path) -> None:
    """Held from construction: another test's in-process server cannot take it and answer ``/health``."""
    server = HTTPServerProcess(lambda port: [str(stand_in), "--port", str(port)], log_path=tmp_path / "log")
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", server.port))
    assert taken.value.errno == errno.EADDRINUSE
    with server:
        assert server.health() == 200


def test_a_server_that_exits_while_starting_says_so_with_its_output(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    server = HTTPServerProcess(lambda port: command, log_path=tmp_path / "log")
    with pytest.raises(RuntimeError, match=r"exited with 3 while starting:\n(.|\n)*no model here"):
        server.start()


def test_llama_server_runs_the_workloads_slots_on_two_threads(stand_in: Path, tmp_path: Path) -> None:
    peer = llama_server_peer(str(stand_in), "/models/smollm2-bf16.gguf", "SmolLM2", parallel=32, context_per_slot=2048)
    with peer.process(prefix_caching=False, log_path=tmp_path / "log") as server:
        argv = _argv(stand_in)
        assert argv[argv.index("--port") + 1] == str(server.port)
    assert peer.name == "llama.cpp" and peer.env is None
    for flag, value in (("-m", "/models/smollm2-bf16.gguf"), ("--alias", "SmolLM2"), ("-t", "2"), ("-tb", "2"),
                        ("-np", "32"), ("-c", str(32 * 2048)), ("--host", "127.0.0.1")):
        assert argv[argv.index(flag) + 1] == value


def test_vllm_runs_its_module_entry_point_tuned_with_prefix_caching_as_asked(tmp_path: Path) -> None:
    peer = vllm_peer("/venv/bin/python", "/models/smollm2", "SmolLM2", "bfloat16", preloads=["/a.so", "/b.so"],
                     kvcache_space="4", max_model_len=1024)
    off, on = peer.command(8011, False), peer.command(8011, True)
    assert off[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag, value in (("--model", "/models/smollm2"), ("--served-model-name", "SmolLM2"), ("--dtype", "bfloat16"),
                        ("--max-model-len", "1024"), ("--port", "8011"), ("--host", "127.0.0.1")):
        assert off[off.index(flag) + 1] == value
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off
    assert "--enable-prefix-caching" in on and "--no-enable-prefix-caching" not in on
    assert peer.env is not None
    assert peer.env["LD_PRELOAD"] == "/a.so:/b.so"
    assert peer.env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert peer.env["VLLM_CPU_OMP_THREADS_BIND"] == VLLM_ENV["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_preloads_are_found_in_the_venv_first(tmp_path: Path) -> None:
    lib = tmp_path / "venv" / "lib"
    lib.mkdir(parents=True)
    for name in ("libtcmalloc_minimal.so.4", "libiomp5.so"):
        (lib / name).touch()
    assert find_preloads(str(tmp_path / "venv" / "bin" / "python")) == [
        str(lib / "libtcmalloc_minimal.so.4"), str(lib / "libiomp5.so")]


def test_a_missing_preload_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "_SYSTEM_LIB_DIRS", ())
    lib = tmp_path / "venv" / "lib"
    lib.mkdir(parents=True)
    (lib / "libiomp5.so").touch()
    with pytest.raises(FileNotFoundError, match=r"libtcmalloc_minimal\.so\.4.*apt-get install libtcmalloc-minimal4"):
        find_preloads(str(tmp_path / "venv" / "bin" / "python"))
    # A command line exits with the same words and the flag that gives them instead.
    with pytest.raises(SystemExit, match=r"apt-get install libtcmalloc-minimal4.*\(--ld-preload\)"):
        preloads_or_exit(str(tmp_path / "venv" / "bin" / "python"), None)
    assert preloads_or_exit("nowhere/bin/python", "/a/libtcmalloc.so.4:/b/libiomp5.so") == [
        "/a/libtcmalloc.so.4", "/b/libiomp5.so"]
