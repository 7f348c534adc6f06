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
answer that is not 200 is logged; the decode side then computes the prompt itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("vllm.ascend.kv_transfer.proxy")


@dataclass
class Instance:
    url: str
    in_flight: int = 0
    down_until: float = 0.0
    kv: tuple[str, int] | None = None  # layer-wise: the prefill connector's host and kv_port


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


def parse_kv_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--prefill-kv wants HOST:KV_PORT, got {text!r}")
    return host, int(port)


def build_app(
    prefill: list[str],
    decode: list[str],
    timeout: float = 600.0,
    cooldown: float = 5.0,
    prefill_kv: list[str] | None = None,
) -> FastAPI:
    """``prefill_kv`` (one ``HOST:KV_PORT`` per prefill instance) turns on layer-wise transfer."""
    pools = {"prefill": Pool("prefill", prefill, cooldown), "decode": Pool("decode", decode, cooldown)}
    if prefill_kv is not None:
        if len(prefill_kv) != len(prefill):
            raise ValueError(
                f"--prefill-kv names {len(prefill_kv)} addresses for {len(prefill)} prefill instances: "
                "give one per --prefill, in the same order"
            )
        for instance, text in zip(pools["prefill"].instances, prefill_kv):
            instance.kv = parse_kv_address(text)
    state: dict = {"background": set()}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # idle connections are closed here before the instances' servers close them (uvicorn:
        # after 5 s), so a request never goes out on a connection the far end is closing
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=2.0)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=5.0), limits=limits)
        yield
        if state["background"]:  # layer-wise prefill requests still running
            await asyncio.wait(state["background"], timeout=timeout)
        await state["client"].aclose()

    app = FastAPI(lifespan=lifespan)

    async def send(pool: Pool, path: str, body: dict, headers: dict, stream: bool):
        """POST to the least-loaded instance of ``pool``; on a connection failure try the next."""
        client: httpx.AsyncClient = state["client"]
        order = pool.order()
        for attempt, instance in enumerate(order + order):  # a second round for dropped connections
            if attempt >= len(order) and instance.down_until > time.monotonic():
                continue
            instance.in_flight += 1
            try:
                req = client.build_request("POST", instance.url + path, json=body, headers=headers)
                response = await client.send(req, stream=stream)
                return instance, response
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

    async def handle(request: Request, path: str):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body must be JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return _error(400, "'stream' must be true or false")
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": request_id}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]

        first = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        first.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in body:
            first["max_completion_tokens"] = 1
        if prefill_kv is not None:
            return await layerwise(path, body, first, headers, stream)
        try:
            instance, answer = await send(pools["prefill"], path, first, headers, stream=False)
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
            instance, answer = await send(pools["decode"], path, second, headers, stream=stream)
        except NoInstance as e:
            return _error(503, str(e))
        return await answer_from(instance, answer, stream)

    async def layerwise(path: str, body: dict, first: dict, headers: dict, stream: bool):
        order = pools["prefill"].order()
        prefill_instance = next((i for i in order if i.down_until <= time.monotonic()), order[0])
        transfer_id = f"lw-{uuid.uuid4().hex}"
        host, port = prefill_instance.kv
        first["kv_transfer_params"] = {"do_remote_decode": True, "layerwise_id": transfer_id}
        task = asyncio.create_task(prefill_only(prefill_instance, path, first, headers))
        state["background"].add(task)  # kept alive until done
        task.add_done_callback(state["background"].discard)
        second = dict(body)
        second["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "layerwise_id": transfer_id,
            "remote_host": host,
            "remote_port": port,
        }
        try:
            instance, answer = await send(pools["decode"], path, second, headers, stream=stream)
        except NoInstance as e:
            task.cancel()  # nobody would read what it computes
            return _error(503, str(e))
        return await answer_from(instance, answer, stream)

    async def prefill_only(instance: Instance, path: str, body: dict, headers: dict) -> None:
        """Layer-wise: the prefill instance's answer is not the client's; a failure is
        logged (the decode side computes the prompt itself)."""
        client: httpx.AsyncClient = state["client"]
        instance.in_flight += 1
        try:
            answer = await client.post(instance.url + path, json=body, headers=headers)
            if answer.status_code != 200:
                logger.warning(
                    "prefill instance %s answered %d: %s", instance.url, answer.status_code, answer.text[:500]
                )
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            pools["prefill"].mark_down(instance, e)
        except httpx.HTTPError as e:
            logger.warning("prefill instance %s: %s: %s", instance.url, type(e).__name__, e)
        finally:
            instance.in_flight -= 1

    async def answer_from(instance: Instance, answer, stream: bool):
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        client: httpx.AsyncClient = state["client"]
        for instance in pools["decode"].order():
            try:
                answer = await client.get(instance.url + "/v1/models", timeout=10)
                return Response(
                    answer.content,
                    status_code=answer.status_code,
                    media_type=answer.headers.get("content-type"),
                )
            except httpx.HTTPError as e:
                pools["decode"].mark_down(instance, e)
        return _error(503, "no decode instance could be reached")

    @app.get("/health")
    async def health():
        client: httpx.AsyncClient = state["client"]

        async def alive(instance: Instance) -> bool:
            try:
                return (await client.get(instance.url + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                return False

        status = {}
        for role, pool in pools.items():
            results = await asyncio.gather(*(alive(i) for i in pool.instances))
            status[role] = {i.url: ok for i, ok in zip(pool.instances, results)}
        healthy = all(any(s.values()) for s in status.values())
        return JSONResponse(status, status_code=200 if healthy else 503)

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
    args = p.parse_args(argv)
    if args.layerwise != bool(args.prefill_kv):
        p.error("--layerwise and --prefill-kv go together")
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(
        build_app(
            args.prefill,
            args.decode,
            args.timeout,
            args.cooldown,
            args.prefill_kv if args.layerwise else None,
        ),
        host=args.host,
        port=args.port,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
