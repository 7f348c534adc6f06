"""Runtime tests: host emulation of the Ascend platform, real vLLM processes.

Needs the built wheel installed (``nox -s tests`` does that). Tiny models are made
by examples/make_tiny_model.py into a session temp dir; Hugging Face transformers'
greedy ``generate`` is the oracle.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

try:
    import vllm  # noqa: F401  (first: its bootstrap hides a CANN-less torch_npu)
except ImportError:  # pragma: no cover - the builder-only environment
    pytest.skip("vllm (the built wheel) is not installed in this environment", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("llama", "qwen2", "deepseek_v3")
# The DeepSeek variant whose MLA sizes (latent 512, rope 64) torch_npu's MLA kernel takes.
MLA512 = "deepseek_v3_mla512"
# A Qwen2 with one KV head: at TP=2 each rank holds a replica of it, which DCP shards.
QWEN2_KV1 = "qwen2_kv1"

# Mixed lengths (2..~60 tokens) so batches mix short and long prefill.
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was a small model that learned to count: one two three",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and punctuation , . ; : ! ?",
    "Attention",
    "Paged attention stores keys and values in fixed-size blocks. Prefill processes the prompt; "
    "decode produces one token at a time. Mixture of experts routes each token to a few experts.",
    "A journey of a thousand miles",
    "Speculative decoding drafts tokens and verifies them in one step.",
    "Large language models predict the next token from the tokens before it. Attention lets every "
    "position look at the positions that came earlier.",
    "Disaggregated serving",
]
SHARED_PREFIX = ("Large language models predict the next token from the tokens before it. "
                 "Attention lets every position look at the positions that came earlier. ")
PREFIX_PROMPTS = [SHARED_PREFIX + tail for tail in ("Once upon", "Numbers 7 8", "The lazy dog", "Decode")]

# Longer prompts for the NPU kernels, whose KV blocks hold 128 tokens: 2 to ~470 tokens.
_SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "Large language models predict the next token from the tokens before it.",
    "Attention lets every position look at the positions that came earlier.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Prefill processes the prompt; decode produces one token at a time.",
    "Mixture of experts routes each token to a few experts.",
    "Speculative decoding drafts tokens and verifies them in one step.",
    "Disaggregated serving runs prefill and decode on different instances.",
    "Once upon a time there was a small model that learned to count: one two three four five.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and punctuation , . ; : ! ?",
]


def sentences(start: int, count: int) -> str:
    return " ".join(_SENTENCES[(start + i * 5) % len(_SENTENCES)] for i in range(count))


LONG_PROMPTS = ["Attention", "The quick brown fox"] + [sentences(s, n) for s, n in
                                                         ((1, 2), (2, 5), (3, 8), (4, 12), (5, 15), (6, 19))]
LONG_PREFIX = sentences(7, 13) + " "
LONG_PREFIX_PROMPTS = [LONG_PREFIX + tail for tail in ("Once upon", "Numbers 7 8", "The lazy dog")]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("models")
    out = {}
    variants = {arch: [] for arch in ARCHS}
    variants[MLA512] = ["--arch", "deepseek_v3", "--kv-lora-rank", "512"]
    variants[QWEN2_KV1] = ["--arch", "qwen2", "--kv-heads", "1"]
    for name, args in variants.items():
        out[name] = make_model(base / name, *(args or ["--arch", name]))
    return out


# A single-rank engine with its engine core in the runner process (upstream's switch): the
# same scheduler and model runner without a second Python start. Multi-rank, serving and
# NPU-kernel engines keep the engine core as its own process.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def make_model(out: Path, *args: str) -> Path:
    """A tiny model by examples/make_tiny_model.py (``args``: its options)."""
    made = subprocess.run([sys.executable, str(ROOT / "examples" / "make_tiny_model.py"), *args, "--out", str(out)],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-3000:]
    return out


def quantize_model(model: Path, out: Path, scheme: str, *extra: str) -> Path:
    """An msModelSlim W8A8 checkpoint of ``model`` by examples/quantize_tiny_model.py."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "quantize_tiny_model.py"), "--model", str(model),
                           "--out", str(out), "--scheme", scheme, *extra], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def run_spec(spec: dict, timeout: int = 900, env: dict | None = None) -> tuple[dict, str]:
    """Run tests/runtime/vllm_runner.py in a fresh process (``env``: added to its
    environment; a run's own "env" overrides it for that run): (its JSON result, its whole
    output: vLLM logs to stdout, Python warnings and tracebacks go to stderr)."""
    env = dict(os.environ, VLLM_ASCEND_EMULATE="1", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "tests.runtime.vllm_runner", json.dumps(spec)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout + proc.stderr


def run_vllm(model: Path, batches: list[list[str]], engine: dict | None = None, max_tokens: int = 16,
             timeout: int = 600, chats: list[list[dict]] | None = None) -> dict:
    spec = {"model": str(model), "engine": {"dtype": "float32", "max_model_len": 512, "seed": 0,
                                            **(engine or {})},
            "batches": batches, "chats": chats or [], "max_tokens": max_tokens,
            "env": IN_PROCESS}
    return run_spec(spec, timeout)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> str:
    exe = Path(sys.executable).with_name("vllm")
    return str(exe) if exe.exists() else shutil.which("vllm")


_HANDED_OUT: set[int] = set()


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports on 127.0.0.1, below the kernel's
    ephemeral range (P/D control planes use ``kv_port + rank`` and bind them only after
    the model has loaded: a port from the ephemeral range may be taken by then by any
    outgoing connection or by a library asking the kernel for a free port)."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    low = min(low, 32768)
    for _ in range(200):
        first = random.randrange(20000, low - count)
        if _HANDED_OUT.intersection(range(first, first + count)):
            continue  # given to an instance of this session that may not have bound it yet
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first, first + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            _HANDED_OUT.update(range(first, first + count))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports between 20000 and {low}")


class VllmServer:
    """``vllm serve`` in host emulation on 127.0.0.1, started at once; ``wait`` until healthy."""

    def __init__(self, model: Path, args: list[str], log: Path, env: dict | None = None):
        self.port, self.log = free_port(), log
        cmd = [vllm_cli(), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, env=dict(os.environ, VLLM_ASCEND_EMULATE="1", **(env or {})),
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve ({self.log.name}) exited with {self.proc.returncode}:\n"
                            f"{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve ({self.log.name}) not healthy in time:\n{self.log.read_text()[-4000:]}")
            time.sleep(1)

    def stop(self) -> None:
        # SIGTERM to `vllm serve` alone, as a service manager stops it: its process manager
        # then stops the API servers and engine cores in order. Signalling the whole group
        # at once races them (with DP, an API server logs EngineDeadError as its engine
        # core exits first), so the group only gets SIGKILL for what is left afterwards.
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
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


def clean_shutdown(output: str) -> None:
    """Engine processes ended without a traceback or a force-kill."""
    assert "Traceback" not in output, output[-4000:]
    assert "force killing" not in output, output[-4000:]


_HF_CACHE: dict = {}


def hf_greedy(model: Path, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    """Oracle: transformers' greedy generate, one prompt at a time, float32, no EOS stop."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = str(model)
    if key not in _HF_CACHE:
        tok = AutoTokenizer.from_pretrained(model)
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        _HF_CACHE[key] = (tok, hf)
    tok, hf = _HF_CACHE[key]
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tok(prompt, return_tensors="pt").input_ids
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=tok.pad_token_id)
            outs.append(gen[0, ids.shape[1]:].tolist())
    return outs
