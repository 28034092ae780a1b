"""The api actor: the OpenAI-compatible HTTP front of one hkv instance.

    client --HTTP/SSE--> handlers --RouterLink--> router
                            ^-- RequestStream <-- deltas

Each generation request is validated (hkv/openai/protocol.py) and tokenized
before anything is queued, fans out into one GenerateRequest per choice, and
reads its sequences' deltas from a RequestStream. Text is detokenized and
stop strings are matched here (hkv/openai/generation.py); the router handles
EOS and max_tokens. A client that goes away aborts its sequences at once.

Big text prompts are tokenized in a separate process (hkv/openai/tokenize.py)
after a size check, so neither the GIL nor their memory lands here. Clients
get `server.request_timeout_s` to send a request (408 after) and at most
`server.max_connections` connections (hkv/openai/http_limits.py).

The api serves HTTP while the ranks still start: `/health` answers 200, `/ready`
503 with `starting` and the start-up phase the launcher keeps in the `startup`
block (hkv/ipc/startup.py), and generation requests 503 (`not_ready`) until the
router first reports that it admits.

On SIGTERM (`ctx.stop`) the api drains: new requests get 503, in-flight ones
finish within `server.drain_timeout_s`, then the server closes and `serve`
returns. When the engine is gone (`ctx.abandoned`: the launcher died, or told
us another actor did) nothing in flight can finish: every stream ends with an
error event and `[DONE]`, every waiting request gets 503, and `serve` returns
within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import jinja2
import msgspec
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from hkv.config import HkvConfig, KeyHash
from hkv.ipc.auth import load_secret
from hkv.ipc.channel import Receiver, Sender
from hkv.ipc.messages import Inbound, Outbound
from hkv.ipc.process import ActorContext, run_actor, run_until_stopped
from hkv.models.tokenizer import Tokenizer, TokenizerError
from hkv.openai.chat_constraint import constrain_chat
from hkv.openai.chat_output import ChatOutputParser, chat_parser
from hkv.openai.generation import ChoiceUpdate, Generation
from hkv.openai.http_limits import BoundedSite, InFlight
from hkv.openai.metrics import ApiMetrics
from hkv.openai.openapi import openapi_document
from hkv.openai.pd_route import NO_ROUTE, PdFront, PdRoute
from hkv.openai.protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ChatRequest,
    CompletionRequest,
    ModelLimits,
    Options,
    ProtocolError,
    decode_body,
    parse_chat,
    parse_completion,
    plan_sequences,
)
from hkv.openai.responses import DONE_FRAME, ChatFormat, CompletionFormat, error_body, error_frame
from hkv.openai.router_link import RequestStream, RouterLink
from hkv.openai.stats_readers import (
    StartupPhase, attach_engine_stats, attach_pd_stats, attach_startup, attach_tier_stats, malformed_sources,
)  # fmt: skip
from hkv.openai.tokenize import PromptEncoder, TokenizeWorker, longest_token_chars
from hkv.openai.tokenize_api import parse_detokenize, parse_tokenize

log = logging.getLogger("hkv.api")

TOKENIZER_ROUTES = ("/tokenize", "/detokenize")  # the api key's, like /v1/*
ADMIN_PREFIXES = ("/cache/",)  # the admin key's routes (the api key's when there is no admin key)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ABORT_GRACE_S = 5.0  # after the drain timeout: time for aborted handlers to finish
ABANDON_GRACE_S = 1.0  # the engine is gone: time for handlers to send their error events
LINGER_S = 2.0  # an unread body after the response: read (and drop) it this long before closing
HTTP_ERRORS = {404: ("not found", "not_found"), 405: ("method not allowed", "method_not_allowed")}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Format = CompletionFormat | ChatFormat


def _error(
    status: int, message: str, error_type: str, param: str | None = None, code: str | None = None
) -> web.Response:
    body = error_body(message, error_type, param, code)
    return web.Response(status=status, body=body, content_type="application/json")


def _json(payload: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(payload), content_type="application/json")


def _endpoint(request: web.Request) -> str:
    """The route's template, so unknown paths cannot blow up label cardinality."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


class Api:
    """Routes, handlers and drain state of the HTTP front."""

    def __init__(
        self, cfg: HkvConfig, link: RouterLink, prompts: PromptEncoder, limits: ModelLimits, metrics: ApiMetrics,
        startup_phase: StartupPhase = lambda: None,
    ):
        self.cfg = cfg
        self.link = link
        self.startup_phase = startup_phase  # what the ranks do while they start (the launcher's `startup` block)
        self.prompts = prompts
        self.tokenizer: Tokenizer = prompts.tokenizer
        self.limits = limits
        self.metrics = metrics
        self.openapi = msgspec.json.encode(openapi_document(cfg, limits))
        self.draining = False
        self.in_flight = InFlight()  # generation handlers running
        self._seeds = random.Random()  # seeds for requests that bring none
        self._started = int(time.time())
        secret = load_secret(cfg.server.secret_file) if cfg.server.mode == "decode" else None
        self.pd = PdFront(cfg.server.mode, cfg.run_dir, secret)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.server.max_body_bytes, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/openapi.json", self.openapi_page)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/cache/flush", self.cache_flush)
        app.router.add_get("/pd/info", self.pd_info)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every failure becomes OpenAI error JSON; only our own bugs are 5xx."""
        endpoint = _endpoint(request)
        try:
            response = await handler(request)
        except ProtocolError as exc:
            response = _error(exc.status, exc.message, exc.error_type, exc.param, exc.code)
        except web.HTTPException as exc:
            message, code = HTTP_ERRORS.get(exc.status, (exc.reason.lower(), None))
            message = f"{message}: {request.method} {request.path}"
            response = _error(exc.status, message, "invalid_request_error", None, code)
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
        except asyncio.CancelledError:
            self.metrics.observe_request(endpoint, 499)  # the client went away
            raise
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.path)
            response = _error(500, "internal server error", "server_error")
        if response.status == 408:
            response.force_close()  # what the client still sends is not worth reading
        self.metrics.observe_request(endpoint, response.status)
        return response

    def _required_key(self, path: str) -> KeyHash | None:
        server = self.cfg.server
        if path.startswith("/v1/") or path in TOKENIZER_ROUTES:
            return server.api_key
        if path.startswith(ADMIN_PREFIXES):
            return server.admin_key or server.api_key
        if path == "/metrics":
            return server.metrics_key
        return None  # probes and the API description stay open

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self._required_key(request.path)
        if key is not None and not key.admits(request.headers.get("Authorization", "")):
            message = "Invalid or missing key for this route (send Authorization: Bearer <key>)."
            raise ProtocolError(401, message, None, "invalid_api_key")
        return await handler(request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await self._read_json(request)
        req = parse_completion(body, self.limits)
        route = self.pd.route(body)
        prompts = await self._completion_prompts(req)
        opts = req.options
        fmt = CompletionFormat(self.limits.model_id, self.tokenizer, opts.return_token_ids, opts.include_usage)
        return await self._generate(request, arrived, opts, prompts, fmt, COMPLETION_DEFAULT_MAX_TOKENS, route)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        body = await self._read_json(request)
        req = parse_chat(body, self.limits)
        route = self.pd.route(body)
        text = self._chat_text(req)
        server = self.cfg.server
        opts = constrain_chat(req, text, server.tool_call_parser, server.reasoning_parser)
        prompts = await self.prompts.encode([text], add_special_tokens=False)
        fmt = ChatFormat(self.limits.model_id, self.tokenizer, opts.return_token_ids, opts.include_usage)
        parser = chat_parser(req, text, server.tool_call_parser, server.reasoning_parser)
        return await self._generate(request, arrived, opts, prompts, fmt, None, route, parser)

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        limit = self.cfg.server.max_body_bytes
        message = f"request body is larger than the limit of {limit} bytes"
        too_large = ProtocolError(413, message, None, "request_too_large")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        timeout = self.cfg.server.request_timeout_s
        try:
            async with asyncio.timeout(timeout):
                body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except TimeoutError:
            raise ProtocolError(408, f"the request body did not arrive within {timeout:g} s", None,
                                "request_timeout") from None
        return decode_body(body)

    async def _completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        texts = [p for p in req.prompts if isinstance(p, str)]
        encoded = iter(await self.prompts.encode(texts, add_special_tokens=True) if texts else [])
        return [list(p) if isinstance(p, tuple) else next(encoded) for p in req.prompts]

    async def tokenize(self, request: web.Request) -> web.Response:
        req = parse_tokenize(await self._read_json(request), self.limits)
        text = req.text if req.chat is None else self._chat_text(req.chat, req.add_generation_prompt)
        (tokens,) = await self.prompts.encode([text], add_special_tokens=req.add_special_tokens)
        return _json({"tokens": tokens, "count": len(tokens), "max_model_len": self.limits.max_seq_len})

    async def detokenize(self, request: web.Request) -> web.Response:
        tokens = parse_detokenize(await self._read_json(request), self.tokenizer.vocab_size)
        return _json({"prompt": self.tokenizer.decode(tokens, skip_special_tokens=False)})

    def _chat_text(self, req: ChatRequest, add_generation_prompt: bool = True) -> str:
        messages = [m.template_dict() for m in req.messages]
        variables = dict(req.template_kwargs)
        if req.tools.tools:
            if req.tools.choice != "none" and self.cfg.server.tool_call_parser is None:
                raise ProtocolError(400, "this server reads no tool calls from answers: the model's chat template "
                                         "teaches no known tool-call format (--tool-call-parser)", "tools")
            variables["tools"] = list(req.tools.tools)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **variables)
        # raise_exception, no template, bad kwargs, tools nested past Python's recursion limit
        except (jinja2.TemplateError, TokenizerError, TypeError, RecursionError) as exc:
            raise ProtocolError(400, f"the chat template rejected the messages: {exc}", "messages") from exc

    @property
    def starting(self) -> bool:
        """The engine has not admitted anything yet and has not failed: the ranks are still starting."""
        return not self.link.first_ready.is_set() and self.link.alive

    def _admit(self, sequences: int) -> None:
        if self.draining:
            raise ProtocolError(503, "the server is shutting down", None, "draining")
        if self.starting:
            phase = self.startup_phase()
            doing = f" ({phase})" if phase else ""
            raise ProtocolError(503, f"the server is starting{doing}; retry once /ready answers 200", None,
                                "not_ready")
        if not self.link.ready:
            stalled = self.link.progress.stalled()
            message = f"the engine is not making progress ({stalled})" if stalled else "the engine is not ready"
            raise ProtocolError(503, message, None, "not_ready")
        limit = self.cfg.scheduler.max_queued_requests
        if self.link.in_flight + sequences > limit:
            raise ProtocolError(429, f"too many requests in flight (limit {limit} sequences)", None, "overloaded")
        if not self.link.has_room(sequences):
            raise ProtocolError(503, "the engine is not keeping up; retry later", None, "overloaded")

    async def _generate(
        self,
        request: web.Request,
        arrived: float,
        options: Options,
        prompts: Sequence[list[int]],
        fmt: Format,
        default_cap: int | None,
        route: PdRoute = NO_ROUTE,
        output_parser: Callable[[], ChatOutputParser] | None = None,
    ) -> web.StreamResponse:
        seed = self._seeds.getrandbits(62)
        if route.for_peer:  # one token out, of the prompt less its last token (hkv/openai/pd_route.py)
            options, prompts = dataclasses.replace(options, max_tokens=1, n=1), PdFront.prompts_for(route, prompts)
        plans = plan_sequences([len(p) for p in prompts], options, self.limits, default_cap, seed)
        self._admit(len(plans))
        bound = sum(p.sampling.max_tokens + 2 for p in plans)
        one = len(plans) == 1  # a ticket names one device hold: several prompts take the CPU path
        stream = self.link.open([(prompts[p.prompt_index], p.sampling) for p in plans], bound, route.peer,
                                route.for_peer, route.device if one else None, route.for_peer and one, arrived)
        want_logprobs = options.logprobs is not None
        gen = Generation(plans, stream.req_ids, prompts, self.tokenizer, options.stop, want_logprobs, arrived,
                         output_parser)
        self.in_flight.enter()
        try:
            if options.stream:
                return await self._stream(request, gen, stream, fmt)
            response = await self._collect(gen, stream, fmt)
            return self.pd.answer_for_peer(response, gen.peer_holds) if route.for_peer else response
        finally:
            self.link.close(stream)
            self.metrics.observe_generation(gen)
            self.in_flight.leave()

    def _apply(self, gen: Generation, stream: RequestStream, deltas: list) -> list[ChoiceUpdate]:
        updates = []
        for delta in deltas:
            if delta.peer_hold is not None:  # prefill mode: named in the answer (hkv/openai/pd_route.py)
                gen.peer_holds.append(delta.peer_hold)
            update = gen.apply(delta)
            if update is None:
                continue
            if update.stop_hit:
                self.link.abort(stream, delta.req_id)
            updates.append(update)
        return updates

    async def _collect(self, gen: Generation, stream: RequestStream, fmt: Format) -> web.Response:
        while not gen.done:
            self._apply(gen, stream, await stream.next_batch())
        if gen.error is not None:
            return _error(503, f"generation failed: {gen.error}", "server_error", None, "engine_failed")
        return web.Response(body=fmt.response(gen), content_type="application/json")

    async def _stream(
        self, request: web.Request, gen: Generation, stream: RequestStream, fmt: Format
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            await response.write(fmt.start_frames(gen))
            while not gen.done:
                updates = self._apply(gen, stream, await stream.next_batch())
                frames = b"".join(fmt.chunk(u) for u in updates)
                if frames:
                    await response.write(frames)
            tail = []
            if gen.error is not None:
                tail.append(error_frame(f"generation failed: {gen.error}", "server_error"))
            if fmt.include_usage:
                tail.append(fmt.usage_frame(gen.usage()))
            await response.write(b"".join(tail) + DONE_FRAME)
            await response.write_eof()
        except ConnectionResetError:
            log.info("client closed a stream early; aborting its sequences")
        except Exception:  # headers are sent: the middleware can no longer answer with JSON
            log.exception("stream failed mid-response")
            self.metrics.observe_request(_endpoint(request), 500)
        return response

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.limits.model_id,
            "object": "model",
            "created": self._started,
            "owned_by": "hkv",
            "max_model_len": self.limits.max_seq_len,
            "vocab_size": self.limits.vocab_size,  # an hkv extension: logit_bias keys lie below it
        }
        return _json({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        if self.link.alive:
            return _json({"status": "ok"})
        return _json({"status": "engine dead"}, 503)

    async def ready(self, request: web.Request) -> web.Response:
        ok = self.link.ready and not self.draining
        state = self.link.state
        engine = None if state is None else {**msgspec.structs.asdict(state), "stalled": self.link.progress.stalled()}
        starting = self.starting
        return _json({"ready": ok, "draining": self.draining, "engine": engine, "starting": starting,
                      "phase": self.startup_phase() if starting else None}, 200 if ok else 503)

    async def pd_info(self, request: web.Request) -> web.Response:
        return _json(self.pd.info())

    async def openapi_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.openapi, content_type="application/json")

    async def metrics_page(self, request: web.Request) -> web.Response:
        self.metrics.observe_engine(self.link.state)
        self.metrics.in_flight.set(self.in_flight.count)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def cache_flush(self, request: web.Request) -> web.Response:
        if not self.link.ready:
            raise ProtocolError(503, "the engine is not ready", None, "not_ready")
        try:
            done = await asyncio.wait_for(self.link.flush_cache(), FLUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ProtocolError(503, "the router did not answer the flush in time", None, "busy") from None
        return _json({"flushed": True, "pages": done.pages, "checkpoints": done.checkpoints,
                      "cpu_pages": done.cpu_pages, "disk_files": done.disk_files})

    async def drain(self, timeout: float) -> None:
        """Refuse new work, let in-flight requests finish, abort what is left after `timeout`."""
        self.draining = True
        log.info("draining: %d requests in flight", self.in_flight.count)
        if await self.in_flight.wait_idle(timeout):
            return
        log.warning("drain timed out after %.1fs; aborting %d requests", timeout, self.in_flight.count)
        self.link.fail_all("the server is shutting down", "abort")
        await self.in_flight.wait_idle(ABORT_GRACE_S)

    async def abandon(self, reason: str) -> None:
        """The engine is gone: end every stream with an error event, answer every waiting request 503."""
        self.draining = True
        if self.in_flight.count:
            log.warning("%s: failing %d requests in flight", reason, self.in_flight.count)
        self.link.fail_all(f"the engine is gone: {reason}", "error")
        await self.in_flight.wait_idle(ABANDON_GRACE_S)


FLUSH_TIMEOUT_S = 30.0


def _site_url(runner: web.AppRunner) -> str:
    host, port = runner.addresses[0][:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _limits(cfg: HkvConfig, tokenizer: Tokenizer, kv_tokens: int | None = None) -> ModelLimits:
    """`kv_tokens`: the device KV capacity the router reported (the ranks size the pool on CUDA);
    None before then, or on CPU, where --max-total-tokens (or the context) is the capacity."""
    spec = cfg.model.spec
    capacity = kv_tokens or cfg.cache.max_total_tokens or spec.max_context
    return ModelLimits.of(cfg.model.model, cfg.model.path, spec.vocab_size, spec.max_context,
                          capacity, longest_token_chars(tokenizer))


async def _open_link(cfg: HkvConfig, zctx: zmq.asyncio.Context, stack: contextlib.AsyncExitStack) -> RouterLink:
    receiver: Receiver[Outbound] = Receiver(zctx, cfg.ipc_address("api_in"), Outbound, "api_in")
    sender: Sender[Inbound] = Sender(zctx, cfg.ipc_address("router_in"), "router_in")
    outbox_bound = 2 * cfg.scheduler.max_queued_requests + 64
    return await stack.enter_async_context(RouterLink(receiver, sender, outbox_bound, cfg.server.stall_timeout_s))


async def _start_http(cfg: HkvConfig, api: Api, stack: contextlib.AsyncExitStack) -> str:
    """Listen on the configured address; returns the URL. The runner is cleaned up with `stack`."""
    timeout = cfg.server.request_timeout_s
    # handler_cancellation: a client that hangs up cancels its handler, which aborts its sequences;
    # keepalive_timeout: a connection must bring a complete request head this soon after opening
    # (or after its last response), else aiohttp closes it
    runner = web.AppRunner(api.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                           keepalive_timeout=timeout, lingering_time=min(LINGER_S, timeout))
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = BoundedSite(runner, cfg.server.host, cfg.server.port, cfg.server.max_connections,
                       api.metrics.refused_connections.inc)
    await site.start()
    return _site_url(runner)


async def serve(cfg: HkvConfig, ctx: ActorContext) -> None:
    """Actor body: serve HTTP until ctx.stop, then drain (or, the engine gone, fail what is in flight) and return."""
    tokenizer = Tokenizer.from_folder(cfg.model.path)
    limits = _limits(cfg, tokenizer)
    zctx = zmq.asyncio.Context()
    try:
        async with contextlib.AsyncExitStack() as stack:
            worker = TokenizeWorker(cfg.model.path)
            stack.push_async_callback(worker.aclose)
            await worker.start()
            link = await _open_link(cfg, zctx, stack)
            engine_stats, tier_stats = attach_engine_stats(cfg, stack), attach_tier_stats(cfg, stack)
            metrics = ApiMetrics(malformed_sources(link, engine_stats, tier_stats), engine_stats, tier_stats,
                                 attach_pd_stats(cfg, stack))
            prompts = PromptEncoder(tokenizer, worker, limits)
            api = Api(cfg, link, prompts, limits, metrics, attach_startup(cfg, stack))
            url = await _start_http(cfg, api, stack)
            # Report ready only once the router can admit, so the launcher's ready line means /ready is 200.
            await run_until_stopped(link.first_ready.wait(), ctx.stop)
            if link.state is not None and link.state.kv_tokens is not None:
                api.limits = prompts.limits = _limits(cfg, tokenizer, link.state.kv_tokens)
            if link.ready:
                log.info("serving %s on %s", limits.model_id, url)
                ctx.ready(url=url)
            await ctx.stop.wait()
            if ctx.abandoned is not None:
                await api.abandon(ctx.abandoned)
            else:
                await api.drain(cfg.server.drain_timeout_s)
    finally:
        zctx.destroy(linger=0)


def main() -> None:
    run_actor("api", serve)


if __name__ == "__main__":
    main()
