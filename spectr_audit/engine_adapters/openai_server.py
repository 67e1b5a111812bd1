"""A served engine as a generator: any OpenAI-compatible completions server, requests sent concurrently.

:class:`CompletionsGenerator` posts one ``/v1/completions`` request per row (a token-id prompt,
``max_tokens``, the sampling parameters, a per-request ``seed``, ``return_token_ids``) from a pool
of threads, so the server batches concurrent requests of ragged lengths as it does in deployment;
the continuation is the response's ``token_ids``.  With ``requests=`` (one
:class:`~spectr_audit.contract.requests.Request` per row) each body carries its row's whole request
(:func:`~spectr_audit.engine_adapters.requests.completions_fields`) and the generator returns a
:class:`~spectr_audit.generation.contract.GenerationOutput` with the returned log-probabilities, finish reasons
and usage.  :func:`serve_vllm` starts ``vllm serve`` (its
OpenAI-compatible API server) on the loopback address on a local checkpoint, with or without a
``speculative_config``, waits until it answers ``/health``, and stops it on exit.

With ``metrics=True`` the generator reads the server's own Prometheus counters (``/metrics``) around each call and
reports them as the call's serving counters (``GenerationOutput.stats``); with ``arrival_gap`` the rows of a call
arrive one after another, as clients' requests do, not as one batch.

Only the standard library talks HTTP.  Nothing leaves the machine: the server listens on
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional, Sequence

from spectr_audit.contract.sampling import SamplingParams
from spectr_audit.engine_adapters.requests import completions_fields, vllm_top_n
from spectr_audit.errors import InvalidArgument, SpectrAuditError
from spectr_audit.generation.contract import LOGPROBS_MODES, GenerationContractError, GenerationOutput

__all__ = ["CompletionsGenerator", "ServerError", "free_port", "serve_vllm"]


class ServerError(SpectrAuditError):
    """The server did not start, or answered a request with an error."""


def free_port() -> int:
    """An unused TCP port on the loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: The server's Prometheus series read with ``metrics=True`` (vLLM's names, ``vllm/v1/metrics/loggers.py``
#: lines 528, 673 and 739): two counters, each summed over its label sets and read before and after a call, and
#: the gauge of running requests, read just before each row is sent.
METRIC_COUNTERS = (("vllm:num_preemptions_total", "preemptions"), ("vllm:prefix_cache_hits_total", "cached_tokens"))
METRIC_RUNNING = "vllm:num_requests_running"

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)')


def prometheus_values(text: str, names) -> dict:
    r"""Each of ``names`` summed over its label sets in Prometheus text exposition (absent names left out).

    Examples
    --------
    >>> lines = ['# TYPE vllm:num_preemptions counter', 'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0',
    ...          'vllm:num_preemptions_total{engine="1",model_name="m"} 2.0']
    >>> prometheus_values("\n".join(lines), ["vllm:num_preemptions_total", "vllm:num_requests_running"])
    {'vllm:num_preemptions_total': 5.0}
    """
    wanted, out = set(names), {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or match.group(1) not in wanted:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


def _get(url: str, timeout: float) -> str:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise ServerError(f"{url}: {exc}") from exc


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ServerError(f"{url}: HTTP {exc.code}: {exc.read()[:500]!r}") from exc


#: vLLM reports a log-probability below this as this (``max(logprob, -9999.0)``,
#: ``vllm/entrypoints/openai/completion/serving.py:705`` and ``:723``): read back as -inf.
_LOGPROB_FLOOR = -9999.0
#: The key of a token in the logprob lists under ``return_tokens_as_token_ids``
#: (``vllm/entrypoints/generate/base/serving.py:326-327``).
_TOKEN_ID_PREFIX = "token_id:"


class CompletionsGenerator:
    """``/v1/completions`` with token-id prompts, one request per row, ``concurrency`` at a time.

    Parameters
    ----------
    base_url : str
        E.g. ``http://127.0.0.1:8000``.
    model : str
        The served model's name.
    params : SamplingParams
        The sampling setting of every row when ``generate`` is called without requests.
    concurrency : int
    timeout : float
        Seconds per request.
    detokenizes : bool
        The server has its tokenizer (``vllm serve`` without ``--skip-tokenizer-init``; :func:`serve_vllm` starts it
        with that flag, so False): only then are a request's stop strings and a regular-expression constraint sent.
    logprobs_mode : str
        What the server's log-probabilities are: ``"raw-masked"`` (the log-softmax of the raw logits, before
        penalties, bias, temperature and filters, over the tokens a structured output allows: vLLM's default
        ``logprobs_mode = "raw_logprobs"``, ``vllm/config/model.py:287``, read in ``vllm/v1/sample/sampler.py:81-94``
        from logits the grammar bitmask has masked in place, ``vllm/v1/worker/gpu_model_runner.py:4333-4337``),
        ``"raw"`` (an engine that does not mask them) or ``"processed"`` (a server started with
        ``--logprobs-mode processed_logprobs``).
    arrival_gap : float
        Seconds between the sending of one row of a call and the next (0: all at once, ``concurrency`` at a time):
        requests arriving over time, so later ones join a batch already decoding.
    metrics : bool
        Read the server's Prometheus counters (``/metrics``) around each call and return them as the call's
        serving counters (``GenerationOutput.stats``): ``preemptions`` and ``cached_tokens`` (vLLM's
        ``vllm:num_preemptions_total`` and ``vllm:prefix_cache_hits_total``, the rise over the call, each where the
        server exposes it) and ``joined_running``, the rows sent while the server's ``vllm:num_requests_running``
        gauge, read just before, was above 0.  The counters are the server's, over every client: audit a server
        nobody else is using.

    Notes
    -----
    With requests, each row's body is its request (:func:`~spectr_audit.engine_adapters.requests.completions_fields`:
    every sampling field sent explicitly, the row's limit capped by the request's ``max_tokens``), its seed (the
    request's, else one derived from the audit's seed and the row), ``return_token_ids``, and
    ``ignore_eos = false``: the row ends at the model's end-of-sequence token as a deployed request does.  vLLM
    reads that token from the model's ``generation_config`` even under ``--skip-tokenizer-init`` and treats it as
    a stop token, masked under ``min_tokens`` (``vllm/sampling_params.py:772-800``); so give the audit the model's
    ``eos_token_id``.  (``ignore_eos = true`` would not take it out of the law: vLLM still masks it under
    ``min_tokens``, line 784.)

    The response is read as vLLM writes it (``vllm/entrypoints/openai/completion/serving.py:505-740``): the
    continuation from ``choices[0].token_ids``; the emitted tokens' log-probabilities from
    ``choices[0].logprobs.token_logprobs``; the top-n from ``choices[0].logprobs.top_logprobs``, whose dict at
    each position holds the emitted token and the top ``logprobs`` tokens (``n + 1`` entries when the emitted
    token is not among the top n, ``n`` when it is; ``vllm/logprobs.py:178-209``, serving.py:715-728), so the
    emitted token is dropped from an ``n + 1``-entry dict to leave the top n (with ``logprobs = 0`` the dict holds
    the emitted token alone and no top-n is returned); ``finish_reason`` as the API says (``"stop"`` at an
    end-of-sequence or stop token, ``"length"``); ``usage.completion_tokens`` (one request per row, ``n = 1``).
    A response without a field asked for is a :class:`~spectr_audit.generation.contract.GenerationContractError`
    naming the engine, the row and the field.
    """

    per_row_max_new_tokens = True
    #: ``generate`` takes ``requests=`` (whole requests, one per row) and honours each request's seed (vLLM seeds
    #: each request's own generator).
    accepts_requests = True
    seeded = True

    def __init__(self, base_url: str, model: str, params: Optional[SamplingParams] = None, *, concurrency: int = 8,
                 timeout: float = 300.0, label: str = "", detokenizes: bool = False,
                 logprobs_mode: str = "raw-masked", arrival_gap: float = 0.0, metrics: bool = False):
        if isinstance(arrival_gap, bool) or not isinstance(arrival_gap, (int, float)) or not (
                math.isfinite(arrival_gap) and arrival_gap >= 0):
            raise InvalidArgument(f"arrival_gap: expected seconds >= 0, got {arrival_gap!r}")
        self.arrival_gap, self.metrics = float(arrival_gap), bool(metrics)
        if logprobs_mode not in LOGPROBS_MODES:
            raise InvalidArgument(f"logprobs_mode: expected one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.base_url, self.model = base_url.rstrip("/"), model
        self.params, self.concurrency, self.timeout = params or SamplingParams(), int(concurrency), float(timeout)
        self.detokenizes, self.logprobs_mode = bool(detokenizes), logprobs_mode
        self.name = f"OpenAI-compatible completions at {self.base_url}{' (' + label + ')' if label else ''}"

    def _body(self, prompt, limit: int, seed: int) -> dict:
        p = self.params
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": int(limit), "seed": int(seed),
                "temperature": float(p.temperature), "top_p": float(p.top_p), "return_token_ids": True,
                "ignore_eos": True}
        if int(p.top_k) > 0:
            body["top_k"] = int(p.top_k)
        return body

    def request_body(self, prompt, limit: int, seed: int, request) -> dict:
        """The JSON body of one row under ``request`` (``seed``: the row's derived seed, used when the request has
        none)."""
        body = {"model": self.model, "prompt": list(prompt), "return_token_ids": True, "ignore_eos": False}
        body.update(completions_fields(request, limit, detokenizes=self.detokenizes))
        body.setdefault("seed", int(seed))
        return body

    def _metric_values(self) -> dict:
        return prometheus_values(_get(f"{self.base_url}/metrics", self.timeout),
                                 [name for name, _ in METRIC_COUNTERS] + [METRIC_RUNNING])

    def _send(self, body: dict) -> tuple:
        """One row: (the response, whether the server had requests running when it was sent; None unread)."""
        running = None
        if self.metrics:
            running = self._metric_values().get(METRIC_RUNNING)
        return _post(f"{self.base_url}/v1/completions", body, self.timeout), None if running is None else running > 0

    def _post_all(self, bodies: list) -> tuple:
        """Every row's response, ``concurrency`` in flight at a time, sent ``arrival_gap`` apart, and the call's
        serving counters (None without ``metrics``)."""
        before = self._metric_values() if self.metrics else None
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = []
            for i, body in enumerate(bodies):
                if i and self.arrival_gap:
                    time.sleep(self.arrival_gap)  # the next client's request arrives
                futures.append(pool.submit(self._send, body))
            sent = [future.result() for future in futures]
        stats = None
        if self.metrics:
            after = self._metric_values()
            stats = {here: max(0, int(round(after[name] - before.get(name, 0.0)))) for name, here in METRIC_COUNTERS
                     if name in after}
            seen = [joined for _, joined in sent if joined is not None]
            if seen:
                stats["joined_running"] = sum(seen)
        return [response for response, _ in sent], stats

    def generate(self, prompts, max_new_tokens, seed, requests=None):
        limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(prompts)
        seeds = [(int(seed) * 1_000_003 + row) % (1 << 31) for row in range(len(prompts))]
        if requests is not None:
            if len(requests) != len(prompts):
                raise InvalidArgument(f"requests: {len(requests)} requests for {len(prompts)} prompts")
            # every body is built (and a request the API cannot take refused) before any is sent
            bodies = [self.request_body(p, limit, s, r) for p, limit, s, r in zip(prompts, limits, seeds, requests)]
            responses, stats = self._post_all(bodies)
            rows = [self._parse(row, response, request) for row, (response, request)
                    in enumerate(zip(responses, requests))]
            continuations, logprobs, tops, finishes, usage = (list(column) for column in zip(*rows))
            return GenerationOutput(continuations, logprobs=logprobs, top_logprobs=tops, finish_reasons=finishes,
                                    completion_tokens=usage, logprobs_mode=self.logprobs_mode,
                                    stats=stats)
        responses, stats = self._post_all([self._body(p, limit, s) for p, limit, s in zip(prompts, limits, seeds)])
        out = []
        for response in responses:
            choice = response["choices"][0]
            ids = choice.get("token_ids")
            if ids is None:
                raise ServerError("the server returned no token_ids (it needs return_token_ids support)")
            out.append([int(t) for t in ids])
        return out if stats is None else GenerationOutput(out, stats=stats)

    # -- reading a response ---------------------------------------------------------------
    def _missing(self, row: int, field: str, why: str = "") -> GenerationContractError:
        return GenerationContractError(f"{self.name}, row {row}: the response has no {field}{why}")

    def _parse(self, row: int, response, request) -> tuple:
        """``(token ids, logprobs or None, top-n dicts or None, finish reason, completion tokens)`` of one row."""
        choices = response.get("choices") if isinstance(response, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._missing(row, "choices[0]")
        choice = choices[0]
        ids = choice.get("token_ids")
        if not isinstance(ids, list):
            raise self._missing(row, "choices[0].token_ids", " (the server must support return_token_ids)")
        ids = [int(t) for t in ids]
        finish = choice.get("finish_reason")
        if not isinstance(finish, str):
            raise self._missing(row, "choices[0].finish_reason")
        usage = response.get("usage")
        count = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(count, bool) or not isinstance(count, int):
            raise self._missing(row, "usage.completion_tokens")
        logprobs = top = None
        if request.logprobs is not None:
            logprobs, top = self._logprobs(row, choice.get("logprobs"), ids, request.logprobs)
        return ids, logprobs, top, finish, count

    def _key(self, row: int, field: str, key) -> int:
        digits = key[len(_TOKEN_ID_PREFIX):] if isinstance(key, str) and key.startswith(_TOKEN_ID_PREFIX) else ""
        if not digits.isdigit():
            raise GenerationContractError(f"{self.name}, row {row}: {field} holds {key!r}, not a "
                                          f"'{_TOKEN_ID_PREFIX}N' key (the server must support "
                                          f"return_tokens_as_token_ids)")
        return int(digits)

    def _logprobs(self, row: int, block, ids: list, n: int) -> tuple:
        field = "choices[0].logprobs"
        if not isinstance(block, dict):
            raise self._missing(row, field, f" (the request asked for logprobs = {n})")
        values, tokens = block.get("token_logprobs"), block.get("tokens")
        if not isinstance(values, list) or len(values) != len(ids):
            raise self._missing(row, f"{field}.token_logprobs", f" with one value per emitted token ({len(ids)})")
        if isinstance(tokens, list) and len(tokens) == len(ids):
            for t, (key, token) in enumerate(zip(tokens, ids)):
                if self._key(row, f"{field}.tokens[{t}]", key) != token:
                    raise GenerationContractError(f"{self.name}, row {row}: {field}.tokens[{t}] is {key!r}, the "
                                                  f"emitted token is {token}")
        logprobs = []
        for t, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self._missing(row, f"{field}.token_logprobs[{t}]")
            logprobs.append(_read_logprob(value))
        if not n:
            return logprobs, None
        lists = block.get("top_logprobs")
        if not isinstance(lists, list) or len(lists) != len(ids):
            raise self._missing(row, f"{field}.top_logprobs", f" with one dict per emitted token ({len(ids)})")
        top = []
        for t, (entries, token) in enumerate(zip(lists, ids)):
            if not isinstance(entries, dict):
                raise self._missing(row, f"{field}.top_logprobs[{t}]")
            position = {self._key(row, f"{field}.top_logprobs[{t}]", k): _read_logprob(v) for k, v in entries.items()}
            top.append(vllm_top_n(position, token, n))
        return logprobs, top


def _read_logprob(value) -> float:
    value = float(value)
    return -math.inf if value <= _LOGPROB_FLOOR else value


@contextlib.contextmanager
def serve_vllm(model: str, speculative_config: Optional[dict] = None, *, port: Optional[int] = None,
               served_name: str = "model", startup_timeout: float = 900.0, memory_fraction: float = 0.12,
               extra_args: Sequence[str] = ()) -> Iterator[str]:
    """Run ``vllm serve`` on 127.0.0.1 for the block; yields the base URL (the served model is ``served_name``).

    The server's output goes to a log file; a server that exits or does not answer is a :class:`ServerError`
    holding the log's last lines and its path (kept then; removed after a clean run)."""
    port = port or free_port()
    command = _serve_command(model, speculative_config, port, served_name, memory_fraction, extra_args)
    log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    failed = True
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise ServerError(f"vllm serve exited with status {process.returncode} before answering"
                                  f"{_log_tail(log.name)}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            if time.monotonic() > deadline:
                raise ServerError(f"vllm serve did not answer /health within {startup_timeout:g} s"
                                  f"{_log_tail(log.name)}")
            time.sleep(2.0)
        yield base
        failed = False
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
        if not failed:
            os.unlink(log.name)


def _serve_command(model, speculative_config, port, served_name, memory_fraction, extra_args) -> list:
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
               "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len", "512",
               "--gpu-memory-utilization", str(memory_fraction), *extra_args]
    if speculative_config:
        command += ["--speculative-config", json.dumps(speculative_config)]
    return command


def _log_tail(path: str, lines: int = 20) -> str:
    """``; its log (PATH) ends: ...`` with the last ``lines`` lines of the server's output."""
    try:
        with open(path, errors="replace") as handle:
            tail = handle.read().splitlines()[-lines:]
    except OSError:
        return ""
    return f"; its log ({path}) ends:\n" + "\n".join(tail) if tail else f"; its log ({path}) is empty"
