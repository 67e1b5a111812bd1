"""A served engine as a generator: any OpenAI-compatible completions server, requests sent concurrently.

:class:`CompletionsGenerator` posts one ``/v1/completions`` request per row (a token-id prompt,
``max_tokens``, the sampling parameters, a per-request ``seed``, ``return_token_ids``) from a pool
of threads, so the server batches concurrent requests of ragged lengths as it does in deployment;
the continuation is the response's ``token_ids``.  :func:`serve_vllm` starts ``vllm serve`` (its
OpenAI-compatible API server) on the loopback address on a local checkpoint, with or without a
``speculative_config``, waits until it answers ``/health``, and stops it on exit.

Only the standard library talks HTTP.  Nothing leaves the machine: the server listens on
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional, Sequence

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.errors import SpectrAuditError

__all__ = ["CompletionsGenerator", "ServerError", "free_port", "serve_vllm"]


class ServerError(SpectrAuditError):
    """The server did not start, or answered a request with an error."""


def free_port() -> int:
    """An unused TCP port on the loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc


class CompletionsGenerator:
    """``/v1/completions`` with token-id prompts, one request per row, ``concurrency`` at a time.

    Parameters
    ----------
    base_url : str
        E.g. ``http://127.0.0.1:8000``.
    model : str
        The served model's name.
    params : SamplingParams
    concurrency : int
    timeout : float
        Seconds per request.
    """

    per_row_max_new_tokens = True

    def __init__(self, base_url: str, model: str, params: Optional[SamplingParams] = None, *, concurrency: int = 8,
                 timeout: float = 300.0, label: str = ""):
        self.base_url, self.model = base_url.rstrip("/"), model
        self.params, self.concurrency, self.timeout = params or SamplingParams(), int(concurrency), float(timeout)
        self.name = f"OpenAI-compatible completions at {self.base_url}{' (' + label + ')' if label else ''}"

    def _body(self, prompt, limit: int, seed: int) -> dict:
        p = self.params
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": int(limit), "seed": int(seed),
                "temperature": float(p.temperature), "top_p": float(p.top_p), "return_token_ids": True,
                "ignore_eos": True}
        if int(p.top_k) > 0:
            body["top_k"] = int(p.top_k)
        return body

    def generate(self, prompts, max_new_tokens, seed):
        limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        bodies = [self._body(p, limit, (int(seed) * 1_000_003 + row) % (1 << 31))
                  for row, (p, limit) in enumerate(zip(prompts, limits))]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            responses = list(pool.map(lambda b: _post(f"{self.base_url}/v1/completions", b, self.timeout), bodies))
        out = []
        for response in responses:
            choice = response["choices"][0]
            ids = choice.get("token_ids")
            if ids is None:
                raise ServerError("the server returned no token_ids (it needs return_token_ids support)")
            out.append([int(t) for t in ids])
        return out


@contextlib.contextmanager
def serve_vllm(model: str, speculative_config: Optional[dict] = None, *, port: Optional[int] = None,
               served_name: str = "model", startup_timeout: float = 900.0, memory_fraction: float = 0.12,
               extra_args: Sequence[str] = ()) -> Iterator[str]:
    """Run ``vllm serve`` on 127.0.0.1 for the block; yields the base URL (the served model is ``served_name``)."""
    port = port or free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
               "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
               "--gpu-memory-utilization", str(memory_fraction), *extra_args]
    if speculative_config:
        command += ["--speculative-config", json.dumps(speculative_config)]
    log = open(os.devnull, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise ServerError(f"vllm serve exited with status {process.returncode} before answering")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"vllm serve did not answer /health within {startup_timeout:g} s")
            time.sleep(2.0)
        yield base
    finally:
        if process.poll() is None:
            import signal

            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()
