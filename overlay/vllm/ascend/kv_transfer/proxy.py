"""The xPyD proxy: one OpenAI-compatible endpoint in front of prefill and decode instances.

    python -m vllm.ascend.kv_transfer.proxy --prefill http://p1:8000 [...] \\
        --decode http://d1:8000 [...] [--host 127.0.0.1] --port 9000

Each completion or chat request goes first to a prefill instance (one token, not
streamed, ``kv_transfer_params: {"do_remote_decode": true}``), then, with the
``kv_transfer_params`` that answer carries, to a decode instance, whose answer (streamed
or not) is the client's. Instances are chosen least-loaded (fewest requests in flight
through this proxy); one that cannot be reached is skipped for ``--cooldown`` seconds
and the request is tried on another. ``/health`` is 200 while at least one prefill and
one decode instance answer; ``/v1/models`` comes from a decode instance.

``--layerwise --prefill-kv HOST:KV_PORT [...]`` (one per ``--prefill``, that instance's
connector host and ``kv_port``): each request goes to both at once, with a transfer id
(``layerwise_id``); the decode instance reads each layer of the prompt's KV as the
prefill forward writes it, and the client gets the decode instance's answer. A prefill
answer that is not 200 is logged; the decode side then computes the prompt itself. The
layer-wise parameters are the proxy's own, so it signs them with the deployment's secret
(``VLLM_ASCEND_KV_SECRET`` or ``--kv-secret-file``; ``--insecure`` on a trusted network).

A completion request with several prompts goes through as one request per prompt (each
with its own prefill and its own KV), answered as one (choices numbered as upstream
numbers them, usage summed; streamed: the prompts' chunks as they come, one usage chunk
and one ``[DONE]`` at the end). The prefill request of an ``n`` > 1 request asks for one
sequence and says how many decode requests will read its KV (``readers``: upstream's
decode instance makes one per sequence). Bodies that are not strict JSON (``NaN``, nesting
too deep) are refused with 400.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm.logger import init_logger

from vllm.ascend.kv_transfer import wire
from vllm.ascend.kv_transfer.trust import LAYERWISE_FIELDS, SecretMissing, Trust, load_secret

logger = init_logger("vllm.ascend.kv_transfer.proxy")  # its name also when run as __main__


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    down_until: float = 0.0
    kv: tuple[str, int] | None = None  # layer-wise: the prefill connector's host and kv_port


class Routed(NamedTuple):
    """A request sent to an instance, and its answer (an ``httpx.Response``, maybe streaming)."""

    instance: Instance
    answer: httpx.Response  # maybe streaming


class NoInstance(RuntimeError):
    pass


class Pool:
    def __init__(self, role: str, urls: list[str], cooldown: float):
        self.role = role
        self.instances = [Instance(u.rstrip("/")) for u in urls]
        self.cooldown = cooldown
        self._turn = itertools.count()

    def order(self) -> list[Instance]:
        """Live instances, least loaded first (ties rotate); then the resting ones."""
        now, turn = time.monotonic(), next(self._turn)
        n = len(self.instances)
        ranked = sorted(
            range(n),
            key=lambda i: (self.instances[i].down_until > now, self.instances[i].in_flight, (i - turn) % n),
        )
        return [self.instances[i] for i in ranked]

    def mark_down(self, instance: Instance, error: Exception) -> None:
        instance.down_until = time.monotonic() + self.cooldown
        logger.warning(
            "%s instance %s unreachable (%s: %s); resting it for %.0f s",
            self.role,
            instance.url,
            type(error).__name__,
            error,
            self.cooldown,
        )


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "service_unavailable",
                "code": status,
            }
        },
        status_code=status,
    )


LAYERWISE_VALID_SECONDS = 600.0  # how long a decode instance takes the proxy's layer-wise parameters


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_body(data: bytes) -> dict:
    """The request body as a JSON object, strictly: no NaN or Infinity, no nesting deep
    enough to exhaust the parser (a ``ValueError`` says what is wrong)."""
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("the request body nests too deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError("the request body must be JSON") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    return body


def prompts_of(body: dict) -> list | None:
    """A completion request's prompts when it has several (a list of strings or of token-id
    lists); None for one prompt (a string, or one list of token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return None


def readers_of(body: dict) -> int:
    """How many decode requests read one prompt's KV: upstream makes one per sequence
    (``n``; ``best_of`` candidates where given)."""
    counts = [body.get("n", 1), body.get("best_of") or 1]
    return max(
        1, min(wire.MAX_READERS, max(c for c in counts if isinstance(c, int) and not isinstance(c, bool)))
    )


def merge_answers(answers: list[dict], per_prompt: int) -> dict:
    """Non-streamed answers of one prompt each -> one answer of all: choice ``j`` of prompt
    ``i`` is choice ``i * per_prompt + j``, usage summed."""
    merged = dict(answers[0])
    merged["choices"] = [
        {**choice, "index": i * per_prompt + choice.get("index", 0)}
        for i, answer in enumerate(answers)
        for choice in answer.get("choices", [])
    ]
    usages = [a["usage"] for a in answers if isinstance(a.get("usage"), dict)]
    if usages:
        merged["usage"] = _summed(usages)
    merged.pop("kv_transfer_params", None)
    return merged


def _summed(usages: list[dict]) -> dict:
    return {
        key: sum(u.get(key) or 0 for u in usages)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens")
        if any(key in u for u in usages)
    }


def parse_kv_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--prefill-kv wants HOST:KV_PORT, got {text!r}")
    return host, int(port)


class PDRouter:
    """Routes each request through a prefill and a decode instance: its pools of
    instances, the HTTP client (opened by the app's lifespan) and the layer-wise prefill
    requests still running. ``prefill_kv`` (one ``HOST:KV_PORT`` per prefill instance)
    turns on layer-wise transfer; ``trust`` signs its parameters (the deployment's secret;
    unsigned when insecure)."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        timeout: float = 600.0,
        cooldown: float = 5.0,
        prefill_kv: list[str] | None = None,
        trust: Trust | None = None,
    ):
        self.timeout = timeout
        self.trust = trust or Trust(None)
        self.layerwise_on = prefill_kv is not None
        self.pools = {
            "prefill": Pool("prefill", prefill, cooldown),
            "decode": Pool("decode", decode, cooldown),
        }
        if prefill_kv is not None:
            if len(prefill_kv) != len(prefill):
                raise ValueError(
                    f"--prefill-kv names {len(prefill_kv)} addresses for {len(prefill)} prefill instances: "
                    "give one per --prefill, in the same order"
                )
            for instance, text in zip(self.pools["prefill"].instances, prefill_kv):
                instance.kv = parse_kv_address(text)
        self.client: httpx.AsyncClient | None = None  # while the app runs
        self.background: set[asyncio.Task] = set()  # layer-wise prefill requests still running

    @property
    def http(self) -> httpx.AsyncClient:
        """The HTTP client to the instances (open while the app runs)."""
        if self.client is None:
            raise RuntimeError("the proxy's HTTP client is not open: the app's lifespan opens it")
        return self.client

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # idle connections are closed here before the instances' servers close them (uvicorn:
        # after 5 s), so a request never goes out on a connection the far end is closing
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=5.0), limits=limits)
        yield
        if self.background:  # layer-wise prefill requests still running
            await asyncio.wait(self.background, timeout=self.timeout)
        await self.client.aclose()

    async def send(self, pool: Pool, path: str, body: dict, headers: dict, stream: bool) -> Routed:
        """POST to the least-loaded instance of ``pool``; on a connection failure try the next."""
        client = self.http
        order = pool.order()
        for attempt, instance in enumerate(order + order):  # a second round for dropped connections
            if attempt >= len(order) and instance.down_until > time.monotonic():
                continue
            instance.in_flight += 1
            try:
                req = client.build_request("POST", instance.url + path, json=body, headers=headers)
                response = await client.send(req, stream=stream)
                return Routed(instance, response)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                instance.in_flight -= 1
                pool.mark_down(instance, e)
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                # closed (or reset: a busy host sends RST) before answering, as a keep-alive
                # connection the far end timed out is: try again, do not rest it
                instance.in_flight -= 1
                logger.warning(
                    "%s instance %s dropped the connection (%s); trying again", pool.role, instance.url, e
                )
            except BaseException:
                instance.in_flight -= 1
                raise
        raise NoInstance(f"no {pool.role} instance could be reached")

    async def handle(self, request: Request, path: str) -> Response:
        try:
            body = parse_body(await request.body())
        except ValueError as e:
            return _error(400, str(e))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return _error(400, "'stream' must be true or false")
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": request_id}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        prompts = prompts_of(body) if path == "/v1/completions" else None
        if prompts is None:
            outcome = await self.pipeline(path, body, headers, stream)
            return await self.answer_from(*outcome, stream) if isinstance(outcome, Routed) else outcome
        # one request per prompt, each with its own KV transfer; answered as one
        subs = [
            (dict(body, prompt=prompt), {**headers, "X-Request-Id": f"{request_id}-{i}"})
            for i, prompt in enumerate(prompts)
        ]
        outcomes = await asyncio.gather(*(self.pipeline(path, sub, h, stream) for sub, h in subs))
        errors = [o for o in outcomes if not isinstance(o, Routed)]
        live = [o for o in outcomes if isinstance(o, Routed)]
        bad = next((o for o in live if o[1].status_code != 200), None)
        if errors or bad is not None:  # the first failure is the answer; the rest are let go
            relayed = None if errors else bad  # answer_from lets the relayed one go itself
            reply = errors[0] if errors or bad is None else await self.answer_from(*bad, False)
            for outcome in live:
                if outcome is not relayed:
                    await self.release(*outcome)
            return reply
        per_prompt = body.get("n", 1) if isinstance(body.get("n", 1), int) else 1
        if stream:
            return StreamingResponse(
                self.merged_stream(outcomes, per_prompt),
                status_code=200,
                media_type=outcomes[0][1].headers.get("content-type"),
            )
        answers = []
        for instance, answer in outcomes:
            try:
                await answer.aread()
                answers.append(answer.json())
            finally:
                await self.release(instance, answer)
        return JSONResponse(merge_answers(answers, per_prompt))

    async def release(self, instance: Instance, answer: httpx.Response) -> None:
        instance.in_flight -= 1
        await answer.aclose()

    async def merged_stream(self, outcomes: list[Routed], per_prompt: int) -> AsyncIterator[str]:
        """The prompts' streams as they come, choices renumbered; one usage chunk (summed) and
        one ``[DONE]`` at the end."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, instance: Instance, answer):
            try:
                async for line in answer.aiter_lines():
                    await queue.put((i, line))
            finally:
                await self.release(instance, answer)
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, *o)) for i, o in enumerate(outcomes)]
        usages, last, open_streams = [], None, len(tasks)
        try:
            while open_streams:
                i, line = await queue.get()
                if line is None:
                    open_streams -= 1
                    continue
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                last = chunk
                if not chunk.get("choices") and isinstance(chunk.get("usage"), dict):
                    usages.append(chunk["usage"])  # the final usage chunk of one prompt
                    continue
                for choice in chunk.get("choices", []):
                    choice["index"] = i * per_prompt + choice.get("index", 0)
                yield f"data: {json.dumps(chunk)}\n\n"
            if usages and last is not None:
                yield f"data: {json.dumps(dict(last, choices=[], usage=_summed(usages)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()

    async def pipeline(self, path: str, body: dict, headers: dict, stream: bool) -> Routed | Response:
        """One prompt through prefill and decode: (decode instance, its answer), or the
        Response to give the client instead."""
        first = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "best_of")}
        first.update(
            stream=False,
            max_tokens=1,
            n=1,  # one sequence is prefilled; each of the decode's n sequences reads it
            kv_transfer_params={"do_remote_decode": True, "readers": readers_of(body)},
        )
        if "max_completion_tokens" in body:
            first["max_completion_tokens"] = 1
        if self.layerwise_on:
            return await self.layerwise(path, body, first, headers, stream)
        try:
            instance, answer = await self.send(self.pools["prefill"], path, first, headers, stream=False)
        except NoInstance as e:
            return _error(503, str(e))
        try:
            if answer.status_code != 200:  # the client's mistake (4xx) or the instance's: pass it on
                return Response(
                    answer.content,
                    status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"),
                )
            params = answer.json().get("kv_transfer_params")
        finally:
            instance.in_flight -= 1
            await answer.aclose()
        second = dict(body)
        if params:
            second["kv_transfer_params"] = params
        try:
            return await self.send(self.pools["decode"], path, second, headers, stream=stream)
        except NoInstance as e:
            return _error(503, str(e))

    async def layerwise(
        self, path: str, body: dict, first: dict, headers: dict, stream: bool
    ) -> Routed | Response:
        order = self.pools["prefill"].order()
        prefill_instance = next((i for i in order if i.down_until <= time.monotonic()), order[0])
        transfer_id = f"lw-{uuid.uuid4().hex}"
        if prefill_instance.kv is None:  # build_app gives every prefill instance one
            raise RuntimeError(
                f"prefill instance {prefill_instance.url} has no KV address for layer-wise transfer"
            )
        host, port = prefill_instance.kv
        first["kv_transfer_params"] = dict(first["kv_transfer_params"], layerwise_id=transfer_id)
        task = asyncio.create_task(self.prefill_only(prefill_instance, path, first, headers))
        self.background.add(task)  # kept alive until done
        task.add_done_callback(self.background.discard)
        second = dict(body)
        params = {
            "do_remote_prefill": True,
            "layerwise_id": transfer_id,
            "remote_host": host,
            "remote_port": port,
            # as many readers as the prefill side holds the transfer for (its ``readers``)
            "remote_readers": first["kv_transfer_params"]["readers"],
        }
        second["kv_transfer_params"] = self.trust.sign_params(
            params, LAYERWISE_FIELDS, LAYERWISE_VALID_SECONDS
        )
        try:
            return await self.send(self.pools["decode"], path, second, headers, stream=stream)
        except NoInstance as e:
            task.cancel()  # nobody would read what it computes
            return _error(503, str(e))

    async def prefill_only(self, instance: Instance, path: str, body: dict, headers: dict) -> None:
        """Layer-wise: the prefill instance's answer is not the client's; a failure is
        logged (the decode side computes the prompt itself)."""
        client = self.http
        instance.in_flight += 1
        try:
            answer = await client.post(instance.url + path, json=body, headers=headers)
            if answer.status_code != 200:
                logger.warning(
                    "prefill instance %s answered %d: %s", instance.url, answer.status_code, answer.text[:500]
                )
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.pools["prefill"].mark_down(instance, e)
        except httpx.HTTPError as e:
            logger.warning("prefill instance %s: %s: %s", instance.url, type(e).__name__, e)
        finally:
            instance.in_flight -= 1

    async def answer_from(self, instance: Instance, answer: httpx.Response, stream: bool) -> Response:
        """The decode instance's answer, relayed (streamed when asked)."""
        if not stream or answer.status_code != 200:
            try:
                await answer.aread()
                return Response(
                    answer.content,
                    status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"),
                )
            finally:
                instance.in_flight -= 1
                await answer.aclose()

        async def relay():
            try:
                async for chunk in answer.aiter_raw():
                    yield chunk
            finally:
                instance.in_flight -= 1
                await answer.aclose()

        return StreamingResponse(relay(), status_code=200, media_type=answer.headers.get("content-type"))

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, "/v1/completions")

    async def chat(self, request: Request) -> Response:
        return await self.handle(request, "/v1/chat/completions")

    async def models(self) -> Response:
        client = self.http
        for instance in self.pools["decode"].order():
            try:
                answer = await client.get(instance.url + "/v1/models", timeout=10)
                return Response(
                    answer.content,
                    status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"),
                )
            except httpx.HTTPError as e:
                self.pools["decode"].mark_down(instance, e)
        return _error(503, "no decode instance could be reached")

    async def health(self) -> Response:
        client = self.http

        async def alive(instance: Instance) -> bool:
            try:
                return (await client.get(instance.url + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                return False

        status = {}
        for role, pool in self.pools.items():
            results = await asyncio.gather(*(alive(i) for i in pool.instances))
            status[role] = {i.url: ok for i, ok in zip(pool.instances, results)}
        healthy = all(any(s.values()) for s in status.values())
        return JSONResponse(status, status_code=200 if healthy else 503)


def build_app(
    prefill: list[str],
    decode: list[str],
    timeout: float = 600.0,
    cooldown: float = 5.0,
    prefill_kv: list[str] | None = None,
    trust: Trust | None = None,
) -> FastAPI:
    """The proxy's app: a ``PDRouter`` of these instances behind its routes."""
    router = PDRouter(prefill, decode, timeout, cooldown, prefill_kv, trust)
    app = FastAPI(lifespan=router.lifespan)
    app.post("/v1/completions")(router.completions)
    app.post("/v1/chat/completions")(router.chat)
    app.get("/v1/models")(router.models)
    app.get("/health")(router.health)
    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(
        prog="python -m vllm.ascend.kv_transfer.proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request")
    p.add_argument("--cooldown", type=float, default=5.0, help="seconds an unreachable instance rests")
    p.add_argument(
        "--layerwise",
        action="store_true",
        help="send each request to prefill and decode at once; decode reads each layer as it is written",
    )
    p.add_argument(
        "--prefill-kv",
        nargs="+",
        metavar="HOST:KV_PORT",
        help="with --layerwise: each prefill instance's connector host and kv_port, in --prefill order",
    )
    p.add_argument(
        "--kv-secret-file",
        help="with --layerwise: the deployment's shared secret, to sign the layer-wise parameters "
        "(VLLM_ASCEND_KV_SECRET wins over it)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="with --layerwise: no secret, the instances run with kv_connector_extra_config.insecure",
    )
    args = p.parse_args(argv)
    if args.layerwise != bool(args.prefill_kv):
        p.error("--layerwise and --prefill-kv go together")
    trust = Trust(None)
    if args.layerwise:
        try:
            trust = Trust(load_secret(args.kv_secret_file, args.insecure))
        except SecretMissing as e:
            p.error(str(e).replace("kv_connector_extra_config.secret_file", "--kv-secret-file"))
    uvicorn.run(
        build_app(
            args.prefill,
            args.decode,
            args.timeout,
            args.cooldown,
            args.prefill_kv if args.layerwise else None,
            trust,
        ),
        host=args.host,
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
