"""vLLM engines in host emulation, each in its own process: ``LLM`` runs by
``harness/vllm_runner.py`` (``run_spec``, ``run_vllm``) and ``vllm serve``
instances (``VllmServer``, ``vllm_server``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harness.ports import free_port
from harness.stacks import MARKER as stacks_marker
from harness.stacks import stacks_if_slow

from .models import ROOT

# A single-rank engine with its engine core in the runner process (upstream's switch): the
# same scheduler and model runner without a second Python start. Multi-rank, serving and
# NPU-kernel engines keep the engine core as its own process.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# what every worker of rank 0 logs at start-up (vllm.ascend.worker.worker)
RUNNER_LINE = "Ascend model runner: NPUModelRunner (Model Runner V2)\n"


def run_spec(spec: dict, timeout: int = 900, env: dict | None = None) -> tuple[dict, str]:
    """Run harness/vllm_runner.py in a fresh process (``env``: added to its
    environment; a run's own "env" overrides it for that run): (its JSON result, its whole
    output: vLLM logs to stdout, Python warnings and tracebacks go to stderr)."""
    env = dict(os.environ, VLLM_ASCEND_EMULATE="1", **(env or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "harness.vllm_runner", json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :]), proc.stdout + proc.stderr


def run_vllm(
    model: Path,
    batches: list[list[str]],
    engine: dict | None = None,
    max_tokens: int = 16,
    timeout: int = 600,
    chats: list[list[dict]] | None = None,
) -> dict:
    spec = {
        "model": str(model),
        "engine": {"dtype": "float32", "max_model_len": 512, "seed": 0, **(engine or {})},
        "batches": batches,
        "chats": chats or [],
        "max_tokens": max_tokens,
        "env": IN_PROCESS,
    }
    return run_spec(spec, timeout)[0]


def vllm_cli() -> str:
    exe = Path(sys.executable).with_name("vllm")
    return str(exe) if exe.exists() else shutil.which("vllm")


class VllmServer:
    """``vllm serve`` in host emulation on 127.0.0.1, started at once; ``wait`` until healthy.
    ``headless``: a node without an API server (``--headless``), for multi-node launches;
    nothing to wait for, it serves through the head node."""

    def __init__(
        self, model: Path, args: list[str], log: Path, env: dict | None = None, headless: bool = False
    ):
        self.port, self.log = free_port(), log
        front = ["--headless"] if headless else ["--host", "127.0.0.1", "--port", str(self.port)]
        cmd = [vllm_cli(), "serve", str(model), *front, *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                env=dict(os.environ, VLLM_ASCEND_EMULATE="1", **(env or {})),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, deadline: float, companions: tuple[VllmServer, ...] = ()) -> None:
        """Until healthy; fails as soon as this server or a ``companions`` process (the
        headless nodes it waits for) has exited."""
        while True:
            for server in (self, *companions):
                if server.proc.poll() is not None:
                    pytest.fail(
                        f"vllm serve ({server.log.name}) exited with {server.proc.returncode}:\n"
                        f"{server.log.read_text()[-4000:]}"
                    )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"vllm serve ({self.log.name}) not healthy in time:\n{self.log.read_text()[-4000:]}"
                )
            time.sleep(1)

    def stop(self, grace: float = 60) -> None:
        # SIGTERM to `vllm serve` alone, as a service manager stops it: its process manager
        # then stops the API servers and engine cores in order. Signalling the whole group
        # at once races them (with DP, an API server logs EngineDeadError as its engine
        # core exits first), so the group only gets SIGKILL for what is left afterwards.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            slow = stacks_if_slow(self.proc.pid, 0.75 * grace, include_root=True, out=self.log)
            with contextlib.suppress(subprocess.TimeoutExpired), slow:
                self.proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def kill(self) -> None:
        """SIGKILL every process of the instance at once (a crashed host)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@contextlib.contextmanager
def vllm_server(model: Path, args: list[str], log: Path, timeout: float = 300, env: dict | None = None):
    """``vllm serve`` in host emulation on 127.0.0.1; yields its base URL once healthy
    and stops the whole process group afterwards."""
    server = VllmServer(model, args, log, env)
    try:
        server.wait(time.monotonic() + timeout)
        yield server.url
    finally:
        server.stop()


def greedy_completion(url: str, model: Path, prompt: str, max_tokens: int, timeout: float = 600) -> list[int]:
    """One greedy `/v1/completions` request of exactly ``max_tokens`` tokens: their ids."""
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    response.raise_for_status()
    return response.json()["choices"][0]["token_ids"]


def clean_shutdown(output: str) -> None:
    """Engine processes ended without a traceback or a force-kill."""
    assert "Traceback" not in output, output[-4000:]
    lines = output.splitlines()
    shutdown = [line for line in lines if "[shutdown]" in line]  # upstream's own log lines
    if any("force killing" in line for line in shutdown):
        # what the processes said last before the shutdown started, to tell where one hung
        first = next(i for i, line in enumerate(lines) if "[shutdown]" in line)
        before = "\n".join(lines[max(0, first - 30) : first])
        stacks = "\n".join(line for line in lines if stacks_marker in line)
        raise AssertionError(f"{before}\n--- shutdown ---\n" + "\n".join(shutdown[-40:]) + f"\n{stacks}")
