"""The hand-off of a completion to a decode server (`dwdp serve --decode-url`): vLLM with dwdp's KV
connector (dwdp.integrations.vllm_connector) continues each prompt from the KV artifact dwdp wrote.

The decode request is the prompt followed by dwdp's first token, for the remaining tokens, greedy,
streamed, with the artifact's descriptor as `kv_transfer_params`: the engine loads the prompt's KV
and computes only the first token's position onwards, so every token after the first continues from
the token the client already has. Token ids travel (`return_token_ids`), so nothing is tokenized
twice.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from dwdp.serve.front import FrontConfig

# Completion fields passed on to the decode server as they are (the others are checked or set here).
PASSED_ON = ("stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
             "spaces_between_special_tokens", "seed", "user")


def eos_token_ids(model_dir: str | None, tokenizer, preset_eos: int | None = None) -> frozenset[int]:
    """The tokens a decoded choice stops at, as vLLM takes them: the tokenizer's eos token and the
    model's generation_config.json (else config.json) eos_token_id; `preset_eos` for a preset."""
    ids = set() if preset_eos is None else {preset_eos}
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model_dir is not None:
        for name in ("generation_config.json", "config.json"):
            path = Path(model_dir) / name
            if path.is_file():
                eos = json.loads(path.read_text()).get("eos_token_id")
                if eos is not None:
                    ids.update(int(t) for t in (eos if isinstance(eos, list) else [eos]))
                    break
    return frozenset(ids)


class DecodeError(Exception):
    """The decode server refused or broke off a continuation; `status` is its HTTP status (502 when
    it never answered properly)."""

    def __init__(self, message: str, status: int = 502):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Served:
    """The model a decode server serves: the name to ask for and its longest sequence (None: not said)."""

    name: str
    max_model_len: int | None


@dataclass(frozen=True)
class Delta:
    """Tokens of one choice from the decode server: ids, their text, and the finish reason on the last."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None


class DecodeClient:
    """An async client of the decode server; one per router. transport: for tests (httpx's)."""

    def __init__(self, front: FrontConfig, transport: httpx.AsyncBaseTransport | None = None):
        headers = {"Authorization": f"Bearer {front.decode_api_key}"} if front.decode_api_key else {}
        timeout = httpx.Timeout(front.decode_timeout_s, connect=min(10.0, front.decode_timeout_s))
        self.url = front.decode_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.url, timeout=timeout, headers=headers, transport=transport)
        self._served: Served | None = None

    async def served(self) -> Served:
        """What the decode server serves (asked once, from its /v1/models)."""
        if self._served is None:
            try:
                r = await self._client.get("/v1/models")
            except httpx.HTTPError as exc:
                raise DecodeError(f"decode server {self.url} does not answer: {type(exc).__name__}: {exc}",
                                  503) from None
            if r.status_code != 200:
                raise DecodeError(f"decode server {self.url}/v1/models answered {r.status_code}: {r.text[:200]}", 503)
            models = r.json().get("data") or []
            if not models:
                raise DecodeError(f"decode server {self.url} serves no model", 503)
            self._served = Served(models[0]["id"], models[0].get("max_model_len"))
        return self._served

    async def continuation(self, prompt_ids: list[int], first: int, num_tokens: int, kv_params: dict,
                           options: dict) -> AsyncIterator[Delta | dict]:
        """The `num_tokens` tokens after `prompt_ids` + [first], as they come: Deltas, then the decode
        server's usage (a dict) when it sends one. Raises DecodeError on a refusal, an error event, or a
        stream that ends without [DONE]."""
        served = await self.served()
        body = {"model": served.name, "prompt": list(prompt_ids) + [first], "max_tokens": num_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True, "kv_transfer_params": kv_params, **options}
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    detail = (await r.aread()).decode(errors="replace")[:300]
                    raise DecodeError(f"decode server answered {r.status_code}: {detail}",
                                      r.status_code if 400 <= r.status_code < 500 else 502)
                async for event in _events(r):
                    yield event
        except httpx.HTTPError as exc:
            raise DecodeError(f"decode server {self.url}: {type(exc).__name__}: {exc}") from None

    async def aclose(self) -> None:
        await self._client.aclose()


async def _events(response: httpx.Response) -> AsyncIterator[Delta | dict]:
    """Deltas and usage out of an OpenAI completions event stream."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            raise DecodeError(f"decode server: {error.get('message', error) if isinstance(error, dict) else error}")
        for choice in chunk.get("choices") or ():
            ids = tuple(choice.get("token_ids") or ())
            if ids or choice.get("text") or choice.get("finish_reason"):
                yield Delta(ids, choice.get("text") or "", choice.get("finish_reason"))
        if chunk.get("usage"):
            yield chunk["usage"]
    raise DecodeError("decode server's stream ended without [DONE]")
