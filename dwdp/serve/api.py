"""The router's HTTP API (FastAPI): /v1/prefill, /v1/completions, /v1/models, /health, /metrics,
and POST /admin/fault when the server was started with fault injection (chaos tests).

/v1/completions answers one token per prompt, or whole completions (streamed on `stream=true`) when
a decode server continues them (FrontConfig.decode_url; dwdp.serve.completions). With an API key
(FrontConfig.api_key) every path but /health and /metrics asks for it (dwdp.serve.auth).

Every error is JSON in the OpenAI shape {"error": {"message", "type", "param", "code"}}, with
`param` naming the request field at fault; 429 and 503 carry Retry-After. An unknown path (such as
/v1/chat/completions: this is a prefill server) is a 404 that lists the endpoints there are.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException


from dwdp.serve.auth import BearerAuth
from dwdp.serve.completions import Choice, Completion, lengths
from dwdp.serve.config import prompt_limit
from dwdp.serve.decode import DecodeClient, DecodeError
from dwdp.serve.errors import ServeError, internal_error
from dwdp.serve.front import FrontConfig
from dwdp.serve.kv_budget import KVAdmission, KVBudget
from dwdp.serve.kv_handoff import handoff_descriptor
from dwdp.serve.kv_ledger import KVLedger
from dwdp.serve.metrics import CONTENT_TYPE, ServeMetrics
from dwdp.serve.schemas import (CHAT_UNSUPPORTED_NEUTRAL, COMPLETION_UNSUPPORTED_NEUTRAL, SAMPLING_NEUTRAL,
                               UNSUPPORTED_NEUTRAL, ChatCompletionRequest, CompletionRequest, FaultRequest,
                                PrefillRequest)

RETRY_AFTER_S = 1
log = logging.getLogger("dwdp.serve")


class BodyLimit:
    """ASGI middleware: 413 for bodies over `max_bytes`, by Content-Length or while streaming in,
    before anything is parsed or buffered beyond the limit."""

    class _TooLarge(Exception):
        pass

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send, int(declared))
        seen, too_large = 0, False

        async def limited():
            nonlocal seen, too_large
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                too_large = True
                raise self._TooLarge()
            return message

        async def guarded(message):
            if not too_large:  # the app may turn our exception into its own error; ours wins
                await send(message)

        try:
            await self.app(scope, limited, guarded)
        except self._TooLarge:
            pass
        if too_large:
            await self._reject(send, seen)

    async def _reject(self, send, size: int) -> None:
        error = ServeError(413, "request_too_large", f"request body of {size} bytes or more is over the limit "
                           f"of {self.max_bytes} bytes", param="body")
        await JSONResponse(error.body(), status_code=413)({"type": "http"}, _no_body, send)


async def _no_body():
    return {"type": "http.request", "body": b"", "more_body": False}


def _param(loc) -> str:
    """The request field a validation error points at: ("body", "input_ids", 2) -> "input_ids"."""
    fields = [str(p) for p in loc if p != "body"]
    return fields[0] if fields else "body"


def check_sampling(fields: dict) -> None:
    """ServeError naming the first sampling field whose value would make sampling differ from the
    greedy first token this server returns."""
    for name, neutral in SAMPLING_NEUTRAL.items():
        value = fields.get(name)
        if value is None or (not isinstance(value, bool) and any(value == v for v in neutral)):
            continue
        allowed = " or ".join(repr(v) for v in neutral)
        raise ServeError(400, "invalid_request_error", f"{name}={value!r}: this prefill server returns the greedy "
                         f"first token and does not sample; send {name} {allowed} or leave it out", param=name)


def check_unsupported_fields(fields: dict, chat: bool) -> None:
    """ServeError naming the first field that would change the answer in a way this server does not do
    (structured output, tools, logprobs, ...), at any value but the one that changes nothing."""
    table = {**UNSUPPORTED_NEUTRAL, **(CHAT_UNSUPPORTED_NEUTRAL if chat else COMPLETION_UNSUPPORTED_NEUTRAL)}
    for name, neutral in table.items():
        value = fields.get(name)
        if value is None or any(type(value) is type(v) and value == v for v in neutral):
            continue
        allowed = f"send {' or '.join(repr(v) for v in neutral)} or leave it out" if neutral else "leave it out"
        raise ServeError(400, "invalid_request_error", f"{name}={_short(value)}: this server does not do what "
                         f"{name} asks, and would answer differently from a server that does; {allowed}",
                         param=name)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 64, 1024, 1024


def check_stops(fields: dict, vocab: int) -> None:
    """stop_token_ids: at most MAX_STOP_TOKEN_IDS ids of the vocabulary [0, vocab); stop: a string or strings
    (at most MAX_STOP_STRINGS of MAX_STOP_CHARS)."""
    stops = fields.get("stop_token_ids")
    if stops is not None and not (isinstance(stops, list) and len(stops) <= MAX_STOP_TOKEN_IDS
                                  and all(type(t) is int and 0 <= t < vocab for t in stops)):
        raise ServeError(400, "invalid_request_error", f"stop_token_ids={_short(stops)} must be a list of at most "
                         f"{MAX_STOP_TOKEN_IDS} token ids of the vocabulary [0, {vocab})", param="stop_token_ids")
    stop = fields.get("stop")
    if stop is None:
        return
    strings = [stop] if isinstance(stop, str) else stop
    if (not isinstance(strings, list) or not all(isinstance(x, str) and 0 < len(x) <= MAX_STOP_CHARS for x in strings)
            or len(strings) > MAX_STOP_STRINGS):
        raise ServeError(400, "invalid_request_error", f"stop must be a string or a list of at most "
                         f"{MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters",
                         param="stop")


TEXT_FLAGS = ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output")


def check_text_flags(fields: dict) -> None:
    """The detokenizer's switches (vLLM's names) are true or false, never a string that reads as true."""
    for name in TEXT_FLAGS:
        value = fields.get(name)
        if value is not None and not isinstance(value, bool):
            raise ServeError(400, "invalid_request_error", f"{name}={value!r} must be true or false", param=name)


def client_request_id(request: Request) -> str | None:
    """The client's X-Request-Id (vLLM's disaggregation proxies send one): kept for logs and the hand-off
    descriptor when it is a short printable id, else ignored."""
    value = request.headers.get("x-request-id")
    if value is None or not 0 < len(value) <= 128 or not all(c.isalnum() or c in "-_.:" for c in value):
        return None
    return value


def chat_message(message, index: int) -> dict:
    """One message as chat templates take it: text parts joined by newlines (vLLM's "string" content
    format); a part that is not text is refused naming it."""
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        texts = []
        for j, part in enumerate(message.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ServeError(400, "invalid_request_error", f"messages.{index}.content.{j} is a "
                                 f"{str(part.get('type'))[:40]!r} part; this server takes text parts only",
                                 param=f"messages.{index}.content")
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    return out


def chat_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The prompt's token ids: `messages` rendered with the tokenizer's chat template, then encoded without
    added special tokens (the template writes them), as vLLM's chat endpoint builds its prompt."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ServeError(400, "invalid_request_error", "this server's tokenizer has no chat template: send "
                         "/v1/completions with a prompt instead", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        text.encode("utf-8")
        return tokenizer.encode(text, add_special_tokens=False)
    except Exception as exc:
        log.warning("the chat template could not render the messages: %s: %s", type(exc).__name__, exc)
        raise ServeError(400, "invalid_request_error", "the messages cannot be rendered by this server's chat "
                         "template", param="messages") from None


def _endpoints(app: FastAPI, config) -> list[str]:
    """'METHOD /path' of every API route this server answers (the admin route only when enabled)."""
    out = []
    for route in app.routes:
        if isinstance(route, APIRoute) and (route.path != "/admin/fault" or config.fault_injection):
            out += [f"{method} {route.path}" for method in sorted(route.methods)]
    return out


def create_app(pool, config, tokenizer=None, front: FrontConfig | None = None, ledger: KVLedger | None = None,
               eos_ids: frozenset[int] = frozenset(), decode_transport=None, budget: KVBudget | None = None,
               statvfs=None) -> FastAPI:
    """The router app over a started WorkerPool. `pool.model_info` gives the vocabulary and the
    longest position; prompts up to `prompt_limit` are taken (longer than max_num_tokens: prefilled
    in chunks), longer ones rejected. front: the decode server, KV expiry and API key (default: none
    of them); ledger: where written artifacts are recorded (default: one swept at each /metrics
    scrape); eos_ids: the model's end tokens (a decoded choice stops at them); decode_transport: an
    httpx transport for the decode client (tests); budget: how many KV artifacts (and bytes) may wait
    and what the KV directory keeps free (default: 1024 artifacts, no byte limit); statvfs: the file
    system query of the KV directory (tests)."""
    front = front or FrontConfig()
    app = FastAPI(title="dwdp context server", version="0.1.0")
    if front.api_key is not None:
        app.add_middleware(BearerAuth, api_key=front.api_key)
    ledger_swept_on_scrape = ledger is None
    ledger = ledger or KVLedger(front.kv_ttl_s)
    kv_dir = getattr(pool, "kv_dir", None)
    admission = KVAdmission(budget or KVBudget(front.kv_max_pending), ledger, None if kv_dir is None else str(kv_dir),
                            **({} if statvfs is None else {"statvfs": statvfs}))
    decode = DecodeClient(front, decode_transport) if front.decode_url else None
    metrics = ServeMetrics(pool, ledger)
    app.state.metrics = metrics
    app.state.ledger = ledger
    vocab = pool.model_info["vocab_size"]
    max_prompt, limit_name = prompt_limit(config, pool.model_info)
    worker_dwdp = config.worker_dwdp  # what every worker was started with (None in DEP mode)
    dwdp_config = None if worker_dwdp is None else dataclasses.asdict(worker_dwdp)

    def fail(error: ServeError) -> JSONResponse:
        metrics.error(error.error_type)
        headers = {"Retry-After": str(error.retry_after)} if error.retry_after is not None else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, exc: ServeError):
        return fail(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return fail(ServeError(400, "invalid_json", f"request body is not valid JSON: {first.get('msg')}",
                                   param="body"))
        param = _param(first.get("loc", ()))
        messages = "; ".join(f"{_param(e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5])
        return fail(ServeError(400, "invalid_request_error", messages, param=param))

    @app.exception_handler(HTTPException)
    async def _no_route(request: Request, exc: HTTPException):
        # Starlette's own answers (unknown path, method not allowed) in this API's error shape.
        where = f"{request.method} {request.url.path}"
        if exc.status_code in (404, 405):
            kind = "not_found" if exc.status_code == 404 else "method_not_allowed"
            return fail(ServeError(exc.status_code, kind, f"{where} is not an endpoint of this server; it has "
                                   f"{', '.join(_endpoints(app, config))}"))
        return fail(ServeError(exc.status_code, "http_error", f"{where}: {exc.detail}"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return fail(internal_error(exc, f"{request.method} {request.url.path}"))

    def check_ids(ids: list[int], field: str) -> list[int]:
        if not ids:
            raise ServeError(400, "invalid_request_error", f"{field} is empty: give at least one token", param=field)
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise ServeError(400, "invalid_request_error",
                                 f"{field}[{i}]={token} is outside the vocabulary [0, {vocab})", param=field)
        if len(ids) > max_prompt:
            raise ServeError(400, "context_length_exceeded", f"{field} has {len(ids)} tokens; this server takes "
                             f"at most {max_prompt} per prompt ({limit_name})", param=field)
        return ids

    def tokenize(text: str, field: str) -> list[int]:
        if tokenizer is None:
            raise ServeError(400, "invalid_request_error", f"{field} is text but this server has no tokenizer; "
                             "send token ids", param=field)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ServeError(400, "invalid_request_error", f"{field} is not valid Unicode text: a lone surrogate "
                             f"at character {exc.start}", param=field) from None
        try:
            ids = tokenizer.encode(text, add_special_tokens=True)
        except Exception as exc:
            log.warning("the tokenizer could not encode %s: %s: %s", field, type(exc).__name__, exc)
            raise ServeError(400, "invalid_request_error", f"{field} cannot be tokenized by this server's "
                             "tokenizer", param=field) from None
        return check_ids(ids, field)

    async def prefill(ids: list[int], banned_first: tuple[int, ...] = ()):
        """(PrefillResult, ttft seconds) of one validated prompt."""
        arrival = time.monotonic()
        result = await pool.submit(ids, banned_first) if banned_first else await pool.submit(ids)
        ttft = time.monotonic() - arrival
        metrics.observe(result, ttft)
        if result.kv.get("path"):
            ledger.written(result.kv["path"], result.kv.get("bytes", 0), result.kv.get("num_tokens", 0))
        return result, ttft

    def timing(result, ttft: float) -> dict:
        return {"queue_s": result.queue_s, "prefill_s": result.prefill_s, "kv_write_s": result.kv_write_s,
                "ttft_s": ttft, "batch_size": result.batch_size, "batch_tokens": result.batch_tokens,
                "prefetch_wait_s": result.prefetch_wait_s, "chunks": len(result.chunks) or 1}

    @app.post("/v1/prefill")
    async def v1_prefill(body: PrefillRequest):
        if body.input_ids is not None and body.prompt is not None:
            raise ServeError(400, "invalid_request_error", "give input_ids or prompt, not both", param="prompt")
        if body.input_ids is not None:
            ids = check_ids(body.input_ids, "input_ids")
        elif body.prompt is not None:
            ids = tokenize(body.prompt, "prompt")
        else:
            raise ServeError(400, "invalid_request_error", "input_ids is missing (or give prompt text)",
                             param="input_ids")
        with admission.admit(1, len(ids)):
            result, ttft = await prefill(ids)
        return {"id": result.request_id, "object": "prefill", "model": config.model_name, "rank": result.rank,
                "first_token_id": result.first_token_id, "prompt_tokens": result.prompt_tokens,
                "timing": timing(result, ttft), "kv": result.kv,
                "kv_transfer_params": {"kv_artifacts": [handoff_descriptor(result.request_id, result.kv,
                                                                           config.model_name, front.kv_key)]}}

    async def served_names() -> tuple[str, ...]:
        """The model names a request may ask for: the server's, its --served-model-name, the decode engine's."""
        names = [config.model_name] + ([front.served_model_name] if front.served_model_name else [])
        if decode is not None:
            try:
                names.append((await decode.served()).name)
            except DecodeError:
                pass  # answered below, when the decode server is needed
        return tuple(dict.fromkeys(names))

    async def answer(request: Request, model: str, prompts: list[list[int]], max_tokens: int | None, fields: dict,
                     stream: bool, chat: bool):
        """One validated completion or chat completion of `prompts`, whole or streamed."""
        names = await served_names()
        if model not in names:
            raise ServeError(404, "model_not_found", f"model {model!r} is not served here; this server serves "
                             f"{', '.join(repr(n) for n in names)}", param="model")
        check_sampling(fields)
        check_unsupported_fields(fields, chat)
        params = fields.get("kv_transfer_params")
        # vLLM's disaggregated prefill: the client's proxy sends the decode instance this answer's KV itself.
        remote_decode = isinstance(params, dict) and params.get("do_remote_decode") is True
        decoding = decode is not None and not remote_decode
        limits = lengths(max_tokens if not remote_decode else 1, fields, decoding)
        check_stops(fields, vocab)
        check_text_flags(fields)
        caps = [limits.max_tokens] * len(prompts)
        if decoding:
            try:
                served = await decode.served()
            except DecodeError as exc:
                raise ServeError(exc.status, "decode_unavailable", str(exc), retry_after=RETRY_AFTER_S) from None
            if served.max_model_len is not None:  # vLLM's rule: max_tokens cut to what the context holds
                for i, ids in enumerate(prompts):
                    if len(ids) >= served.max_model_len:
                        raise ServeError(400, "context_length_exceeded", f"Input length ({len(ids)}) leaves no room "
                                         f"for an output in the decode server's maximum context length "
                                         f"({served.max_model_len})", param="prompt")
                    caps[i] = min(caps[i], served.max_model_len - len(ids))
        stop_ids = set(fields.get("stop_token_ids") or ()) | (set() if limits.ignore_eos else set(eos_ids))
        banned = tuple(sorted(stop_ids)) if limits.min_tokens >= 1 else ()
        client_id = client_request_id(request)
        with admission.admit(len(prompts), sum(len(ids) for ids in prompts)):
            answers = await asyncio.gather(*(prefill(ids, banned) for ids in prompts))
        if client_id is not None:
            log.info("request %s: prefilled as %s", client_id, ", ".join(r.request_id for r, _ in answers))
        choices = [Choice(i, ids, result, timing(result, ttft), caps[i]) for i, (ids, (result, ttft))
                   in enumerate(zip(prompts, answers))]
        completion = Completion(choices, limits, fields, model, answers[0][0].request_id.removeprefix("pf-"),
                                tokenizer, decode if decoding else None, eos_ids, ledger if decoding else None,
                                metrics, front.kv_key, chat=chat, client_request_id=client_id,
                                artifact_model=config.model_name)
        if stream:
            return StreamingResponse(completion.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await completion.whole()

    def check_unsupported(body) -> None:
        for name, value, allowed in (("echo", getattr(body, "echo", False), False), ("n", body.n, 1),
                                     ("logprobs", body.logprobs, (None, False))):
            if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
                raise ServeError(400, "invalid_request_error", f"{name}={value!r} is not supported by this "
                                 f"server (only {allowed!r})", param=name)

    @app.post("/v1/completions")
    async def v1_completions(body: CompletionRequest, request: Request):
        fields = body.model_extra or {}
        check_unsupported(body)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and (
                len(prompt) > front.max_prompts_per_request):
            raise ServeError(400, "invalid_request_error", f"prompt holds {len(prompt)} prompts; this server takes at "
                             f"most {front.max_prompts_per_request} per request (--max-prompts-per-request)",
                             param="prompt")
        if isinstance(prompt, str):
            prompts = [tokenize(prompt, "prompt")]
        elif not prompt:
            raise ServeError(400, "invalid_request_error", "prompt is empty", param="prompt")
        elif isinstance(prompt[0], int):
            prompts = [check_ids(prompt, "prompt")]
        else:
            prompts = [tokenize(p, f"prompt.{i}") if isinstance(p, str) else check_ids(p, f"prompt.{i}")
                       for i, p in enumerate(prompt)]
        return await answer(request, body.model, prompts, body.max_tokens, fields, body.stream, chat=False)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(body: ChatCompletionRequest, request: Request):
        fields = body.model_extra or {}
        check_unsupported(body)
        ids = chat_prompt(tokenizer, [chat_message(m, i) for i, m in enumerate(body.messages)],
                          body.add_generation_prompt)
        return await answer(request, body.model, [check_ids(ids, "messages")], body.max_tokens, fields, body.stream,
                            chat=True)

    @app.get("/v1/models")
    async def v1_models():
        names = [config.model_name] + ([front.served_model_name] if front.served_model_name else [])
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "dwdp"}
                                           for name in dict.fromkeys(names)]}

    @app.get("/health")
    async def health():
        snap = pool.snapshot()
        snap["model"] = {"name": config.model_name, **pool.model_info}
        snap["dwdp_config"] = dwdp_config
        return JSONResponse(snap, status_code=200 if snap["status"] in ("ok", "degraded") else 503)

    @app.post("/admin/fault")
    async def admin_fault(body: FaultRequest):
        if not config.fault_injection:
            raise ServeError(404, "not_found", "fault injection is off: start the server with --fault-injection "
                             "to make a rank's memory unreadable on purpose")
        return {"rank": body.rank, "fault": "memory unreadable", "told": pool.inject_fault(body.rank)}

    @app.get("/metrics")
    async def prometheus():
        if ledger_swept_on_scrape:
            ledger.sweep()
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app
