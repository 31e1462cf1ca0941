"""POST /v1/completions past validation: the length fields, then each prompt's choice, whole or as
server-sent events (`stream=true`).

A prefill server (no --decode-url) answers one token per prompt: `max_tokens` (and
`max_completion_tokens`, `min_tokens`) above 1 are refused naming the field; a stream is that one
token's chunk, then [DONE]. Behind --decode-url each choice is dwdp's greedy first token (sent as soon
as the prefill ends: TTFT is dwdp's) followed by the decode server's continuation from the prefill's
KV (dwdp.serve.decode), streamed through as it comes. Text, stop strings, min_tokens and the stop
token's text follow vLLM's front end on the token ids (dwdp.serve.output_text), so the pair answers what
vLLM alone would; the same answers come in the chat completions shape for /v1/chat/completions.
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from dwdp.serve.decode import PASSED_ON, DecodeClient, DecodeError, Delta
from dwdp.serve.errors import ServeError, internal_error
from dwdp.serve.kv_handoff import handoff_descriptor
from dwdp.serve.output_text import OutputText

DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default, when decoding


@dataclass(frozen=True)
class Lengths:
    """How many tokens each choice gets: at most `max_tokens`, no stop before `min_tokens`."""

    max_tokens: int
    min_tokens: int
    ignore_eos: bool


def _int_field(fields: dict, name: str, low: int) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ServeError(400, "invalid_request_error", f"{name}={value!r} must be an integer >= {low}", param=name)
    return value


def lengths(max_tokens: int | None, fields: dict, decoding: bool) -> Lengths:
    """The length fields of a completion request, checked: every one that asks for more than this
    server does is a 400 naming it (a prefill server answers one token)."""
    completion = _int_field(fields, "max_completion_tokens", 1)
    minimum = _int_field(fields, "min_tokens", 0) or 0
    ignore_eos = fields.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ServeError(400, "invalid_request_error", f"ignore_eos={ignore_eos!r} must be true or false",
                         param="ignore_eos")
    if max_tokens is not None and max_tokens < 1:
        raise ServeError(400, "invalid_request_error", f"max_tokens={max_tokens} must be >= 1", param="max_tokens")
    if completion is not None and max_tokens is not None and completion != max_tokens:
        raise ServeError(400, "invalid_request_error", f"max_completion_tokens={completion} and max_tokens="
                         f"{max_tokens} disagree; send one of them", param="max_completion_tokens")
    if not decoding:
        for name, value in (("max_tokens", max_tokens), ("max_completion_tokens", completion),
                            ("min_tokens", minimum)):
            if value is not None and value > 1:
                raise ServeError(400, "invalid_request_error", f"{name}={value}: a context (prefill) server returns "
                                 f"exactly one token; send {name}=1 (or start dwdp serve with --decode-url to "
                                 "decode)", param=name)
        return Lengths(1, minimum, ignore_eos)
    limit = completion if completion is not None else max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS
    if minimum > limit:
        raise ServeError(400, "invalid_request_error", f"min_tokens={minimum} is above max_tokens={limit}",
                         param="min_tokens")
    return Lengths(limit, minimum, ignore_eos)


@dataclass
class Choice:
    """One prompt's choice as it is answered: its prefill, then its output (tokens, text, finish)."""

    index: int
    prompt: list[int]
    result: object                      # dwdp.serve.protocol.PrefillResult
    timing: dict
    max_tokens: int = 1                 # this prompt's (clamped to the decode engine's max_model_len)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens_loaded: int | None = None  # the decode server's cached prompt tokens (its usage), when it says


@dataclass(frozen=True)
class Piece:
    """Tokens of one choice to send: a stream chunk, or part of a whole answer."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    is_first: bool = False


def _output(tokenizer, prompt: list[int], limits: Lengths, fields: dict) -> OutputText:
    return OutputText(tokenizer, prompt, stop=fields.get("stop"), min_tokens=limits.min_tokens,
                      include_stop_str_in_output=fields.get("include_stop_str_in_output") is True,
                      skip_special_tokens=fields.get("skip_special_tokens") is not False,
                      spaces_between_special_tokens=fields.get("spaces_between_special_tokens") is not False)


class Completion:
    """Answers one validated completion (or chat completion) request whose prompts were prefilled.

    Each choice's text is made from its token ids as vLLM's front end makes it (dwdp.serve.output_text):
    dwdp's first token, then the decode engine's tokens; stop strings are checked across both (the decode
    engine cannot see one that starts in dwdp's token), and a stream holds back what may still start one.
    chat: answer in the chat completions shape. remote_decode: vLLM's disaggregated prefill convention
    (one token, the artifact kept for the decode instance the client's proxy picks)."""

    def __init__(self, choices: list[Choice], limits: Lengths, fields: dict, model_name: str, request_id: str,
                 tokenizer=None, decode: DecodeClient | None = None, eos_ids: frozenset[int] = frozenset(),
                 ledger=None, metrics=None, kv_key: bytes | None = None, *, chat: bool = False,
                 client_request_id: str | None = None, artifact_model: str | None = None):
        self.choices, self.limits, self.fields = choices, limits, fields
        self.kv_key, self.chat, self.client_request_id = kv_key, chat, client_request_id
        self.artifact_model = artifact_model or model_name
        self.model_name, self.created = model_name, int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.tokenizer, self.decode, self.eos_ids, self.ledger, self.metrics = (tokenizer, decode, eos_ids, ledger,
                                                                             metrics)
        stops = fields.get("stop_token_ids") or []
        self.stop_ids = frozenset(stops) | (frozenset() if limits.ignore_eos else eos_ids)

    # -- one choice ------------------------------------------------------------------------------
    async def _pieces(self, choice: Choice) -> AsyncIterator[Piece]:
        out = _output(self.tokenizer, choice.prompt, self.limits, self.fields)
        first = choice.result.first_token_id
        # The worker never picks an end or stop token under min_tokens (PrefillJob.banned_first).
        stopped = first in self.stop_ids
        matched = out.update([first], stop_terminated=stopped)
        finish = "stop" if stopped or matched else "length" if choice.max_tokens == 1 else None
        if stopped:
            choice.stop_reason = first if first in (self.fields.get("stop_token_ids") or ()) else None
        elif matched:
            choice.stop_reason = matched
        yield Piece(choice.index, tuple(out.token_ids), out.next_text(finish is not None), finish, is_first=True)
        if self.decode is None:
            return
        path = choice.result.kv.get("path")
        if finish is not None:  # no decode reads this artifact
            if self.ledger is not None and path:
                self.ledger.drop(path)
            return
        try:
            started = time.monotonic()
            options = {name: self.fields[name] for name in PASSED_ON if name in self.fields}
            if self.limits.min_tokens > 1:
                options["min_tokens"] = self.limits.min_tokens - 1
            kv_params = {"kv_artifacts": [self._descriptor(choice)]}
            stream = self.decode.continuation(choice.prompt, first, choice.max_tokens - 1, kv_params, options)
            try:
                async for event in stream:
                    if not isinstance(event, Delta):
                        details = event.get("prompt_tokens_details") or {}
                        choice.prompt_tokens_loaded = details.get("cached_tokens")
                        continue
                    before = len(out.token_ids)
                    ended = event.finish_reason is not None
                    stop_token = ended and event.finish_reason == "stop" and bool(event.token_ids) and \
                        event.token_ids[-1] in self.stop_ids
                    matched = out.update(list(event.token_ids), stop_terminated=stop_token)
                    if matched:  # a stop string the decode engine could not see (it starts in dwdp's token)
                        choice.stop_reason = matched
                        yield Piece(choice.index, tuple(out.token_ids[before:]), out.next_text(True), "stop")
                        break
                    if stop_token:
                        choice.stop_reason = event.token_ids[-1] if event.token_ids[-1] in (
                            self.fields.get("stop_token_ids") or ()) else None
                    yield Piece(choice.index, tuple(out.token_ids[before:]), out.next_text(ended),
                                event.finish_reason)
            finally:
                await stream.aclose()  # closing the stream ends the decode engine's request
            if self.metrics is not None:
                self.metrics.observe_decode(time.monotonic() - started)
        finally:
            if self.ledger is not None and path:
                self.ledger.drop(path)  # read by now, or never: the decode recomputed

    def _record(self, piece: Piece) -> None:
        choice = self.choices[piece.index]
        choice.token_ids += piece.token_ids
        choice.text += piece.text
        if piece.finish_reason is not None:
            choice.finish_reason = piece.finish_reason

    async def _merged(self) -> AsyncIterator[Piece]:
        """Every choice's pieces as they come (choices run side by side)."""
        if len(self.choices) == 1:
            async for piece in self._pieces(self.choices[0]):
                self._record(piece)
                yield piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def run(choice: Choice):
            try:
                async for piece in self._pieces(choice):
                    await queue.put(piece)
            except Exception as exc:  # handed to the reader, which raises it
                await queue.put(exc)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(run(c)) for c in self.choices]
        try:
            left = len(tasks)
            while left:
                item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    self._record(item)
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    # -- answers ---------------------------------------------------------------------------------
    def usage(self) -> dict:
        prompt = sum(c.result.prompt_tokens for c in self.choices)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _choice_extra(self, choice: Choice) -> dict:
        extra = {"rank": choice.result.rank, "timing": choice.timing}
        if self.decode is not None:
            extra["decode"] = {"prompt_tokens_loaded": choice.prompt_tokens_loaded}
        return extra

    def _descriptor(self, choice: Choice) -> dict:
        """The hand-off descriptor of a choice's artifact (dwdp.serve.kv_handoff), signed with the KV key."""
        descriptor = handoff_descriptor(choice.result.request_id, choice.result.kv, self.artifact_model, self.kv_key)
        if self.client_request_id is not None:
            descriptor["client_request_id"] = self.client_request_id
        return descriptor

    def _kv_params(self) -> dict:
        return {"kv_artifacts": [self._descriptor(c) for c in self.choices]}

    def _whole_choice(self, c: Choice) -> dict:
        body = {"index": c.index, "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "token_ids": c.token_ids, **self._choice_extra(c)}
        if self.chat:
            body["message"] = {"role": "assistant", "content": c.text}
        else:
            body["text"] = c.text
        return body

    async def whole(self) -> dict:
        """The whole answer (stream=false)."""
        try:
            async for _ in self._merged():
                pass
        except DecodeError as exc:
            raise ServeError(exc.status, "decode_failed", str(exc)) from None
        self._count_tokens()
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name,
                "choices": [self._whole_choice(c) for c in self.choices], "usage": self.usage(),
                "kv_transfer_params": self._kv_params()}

    def _chunk(self, choices: list[dict], **extra) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def _chunk_choice(self, piece: Piece) -> dict:
        choice = {"index": piece.index, "logprobs": None, "finish_reason": piece.finish_reason,
                  "token_ids": list(piece.token_ids)}
        if piece.finish_reason is not None:
            choice["stop_reason"] = self.choices[piece.index].stop_reason
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": piece.text} if piece.is_first else \
                {"content": piece.text}
        else:
            choice["text"] = piece.text
        if piece.is_first:
            choice.update(self._choice_extra(self.choices[piece.index]))
        return choice

    async def events(self) -> AsyncIterator[str]:
        """Server-sent events (stream=true): a chunk per piece, the usage when asked for
        (stream_options.include_usage), then `data: [DONE]`; a decode failure after the first token
        is an error event before [DONE]."""
        options = self.fields.get("stream_options") or {}
        try:
            async for piece in self._merged():
                extra = {}
                if piece.finish_reason is not None and self.decode is None:
                    extra["kv_transfer_params"] = {"kv_artifacts": [self._descriptor(self.choices[piece.index])]}
                yield self._chunk([self._chunk_choice(piece)], **extra)
        except DecodeError as exc:
            error = ServeError(exc.status, "decode_failed", str(exc))
            yield f"data: {json.dumps(error.body())}\n\n"
        except Exception as exc:  # the status line has gone out: the error travels in the stream
            error = internal_error(exc, f"the stream of {self.id}")
            yield f"data: {json.dumps(error.body())}\n\n"
        self._count_tokens()
        if isinstance(options, dict) and options.get("include_usage"):
            yield self._chunk([], usage=self.usage())
        yield "data: [DONE]\n\n"

    def _count_tokens(self) -> None:
        if self.metrics is not None:
            self.metrics.observe_completion(sum(len(c.token_ids) for c in self.choices))
