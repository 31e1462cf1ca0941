"""Request bodies of the HTTP API (pydantic); checks that need the model (vocabulary, longest
prompt) happen in dwdp.serve.api."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr


class PrefillRequest(BaseModel):
    """POST /v1/prefill: exactly one of `input_ids` (token ids) or `prompt` (text, needs a tokenizer)."""

    model_config = ConfigDict(extra="forbid")

    input_ids: list[StrictInt] | None = None
    prompt: StrictStr | None = None


class CompletionRequest(BaseModel):
    """POST /v1/completions, the prefill side of the OpenAI completions API: one greedy token.

    prompt: text, a list of token ids, or a list of either (one choice per prompt). Fields of the
    OpenAI API that do not change a one-token greedy prefill (temperature, top_p, user, ...) are
    accepted and ignored; `kv_transfer_params` is accepted the way disaggregated proxies send it.
    """

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 1
    stream: StrictBool = False
    echo: StrictBool = False
    n: StrictInt = 1
    logprobs: StrictInt | None = None


class FaultRequest(BaseModel):
    """POST /admin/fault: make `rank`'s memory unreadable (every copy from it fails; it serves nothing)."""

    model_config = ConfigDict(extra="forbid")

    rank: StrictInt
