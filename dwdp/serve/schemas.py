"""Request bodies of the HTTP API (pydantic); checks that need the model (vocabulary, longest
prompt) happen in dwdp.serve.api."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class PrefillRequest(BaseModel):
    """POST /v1/prefill: exactly one of `input_ids` (token ids) or `prompt` (text, needs a tokenizer)."""

    model_config = ConfigDict(extra="forbid")

    input_ids: list[StrictInt] | None = None
    prompt: StrictStr | None = None


class CompletionRequest(BaseModel):
    """POST /v1/completions: one greedy token per prompt (a prefill server), or whole greedy
    completions behind --decode-url (dwdp.serve.completions).

    prompt: text, a list of token ids, or a list of either (one choice per prompt). The first token is
    the greedy (argmax) one, so a sampling field (SAMPLING_NEUTRAL) is accepted only at a value under
    which sampling gives that token, and refused with 400 naming the field otherwise; the length
    fields (max_tokens, max_completion_tokens, min_tokens) are refused above what the server does;
    `kv_transfer_params` is accepted the way disaggregated proxies send it. max_tokens None: 1 on a
    prefill server, 16 when decoding (the API's default).
    """

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = None
    stream: StrictBool = False
    echo: StrictBool = False
    n: StrictInt = 1
    logprobs: StrictInt | None = None


class ChatMessage(BaseModel):
    """One message of a chat: its role and its text (a string, or text parts)."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[dict] | None = None


class ChatCompletionRequest(BaseModel):
    """POST /v1/chat/completions: the messages rendered with the tokenizer's chat template into one prompt,
    then answered as a completion is (the same fields, the chat answer's shape)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: StrictInt | None = None
    stream: StrictBool = False
    n: StrictInt = 1
    logprobs: StrictBool | None = None
    add_generation_prompt: StrictBool = True


# Sampling fields of the OpenAI completions API (and vLLM's extensions) -> the values under which
# sampling one token gives the greedy token this prefill server returns (null is always accepted).
SAMPLING_NEUTRAL = {
    "temperature": (0,), "top_p": (1,), "top_k": (-1, 0, 1), "min_p": (0,), "presence_penalty": (0,),
    "frequency_penalty": (0,), "repetition_penalty": (1,), "best_of": (1,), "logit_bias": ({},),
}


# Fields of vLLM's completions and chat APIs that would change the answer and that this server does not do
# -> the values under which they change nothing (null is always accepted); any other value is refused with
# 400 naming the field, never answered differently. chat: the chat endpoint's own.
UNSUPPORTED_NEUTRAL = {
    "response_format": ({"type": "text"},), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "bad_words": ([],), "allowed_token_ids": (),
    "logits_processors": (), "prompt_logprobs": (), "top_logprobs": (0,), "truncate_prompt_tokens": (),
    "suffix": ("",), "return_tokens_as_token_ids": (False,), "vllm_xargs": (),
}
CHAT_UNSUPPORTED_NEUTRAL = {
    "tools": ([],), "tool_choice": ("none", "auto"), "chat_template": (), "chat_template_kwargs": ({},),
    "continue_final_message": (False,), "documents": (), "echo": (False,), "add_special_tokens": (False,),
}
COMPLETION_UNSUPPORTED_NEUTRAL = {"add_special_tokens": (True,)}


class FaultRequest(BaseModel):
    """POST /admin/fault: make `rank`'s memory unreadable (every copy from it fails; it serves nothing)."""

    model_config = ConfigDict(extra="forbid")

    rank: StrictInt
