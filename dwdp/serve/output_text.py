"""A choice's output as vLLM's own front end makes it from token ids: incremental detokenization after the
prompt, stop strings, min_tokens and the stop token's text, so the pair (dwdp's first token, then the
decode engine's tokens) answers the text vLLM alone would for the same token ids.

vLLM computes a request's text from its output token ids with the tokenizer (`tokenizers`' DecodeStream
primed with the prompt ids; vllm/v1/engine/detokenizer.py), and checks stop strings there: once more than
`min_tokens` tokens are out, in the text from the min_tokens boundary on, truncating before the stop string
(or after it with include_stop_str_in_output). A token that stopped the request (EOS, stop_token_ids) is
counted but its text is left out unless include_stop_str_in_output. A stream holds back the last
len(longest stop) - 1 characters until the request finishes, since they may yet start a stop string.
The decode engine sees dwdp's first token as part of its prompt, so its own stop checks cannot span that
token and its streamed text misses it: the router recomputes the text here from the token ids instead.
"""
from __future__ import annotations

import logging
import sys
from bisect import bisect_left

log = logging.getLogger("dwdp.serve")


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """(stop string, offset to truncate the text to, -1 for none) of the stop string completing earliest
    in the last `new_char_count` characters, or None (vLLM's check_stop_strings)."""
    if not new_char_count or not stop:
        return None
    best, best_index, best_end = None, 0, sys.maxsize
    for stop_str in stop:
        index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if index == -1:
            continue
        end = index + len(stop_str)
        if end < best_end:
            best, best_index, best_end = stop_str, index, end
    if best is None:
        return None
    if include_in_output:
        return best, (-1 if best_end >= len(output_text) else best_end)
    return best, best_index


class OutputText:
    """One choice's output tokens and text. tokenizer: a transformers fast tokenizer (or None: no text);
    prompt: the prompt's token ids; stop: stop strings; min_tokens: tokens before a stop may match."""

    def __init__(self, tokenizer, prompt: list[int], *, stop: list[str] | None = None, min_tokens: int = 0,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        self.min_tokens = min_tokens
        self.include_stop = include_stop_str_in_output
        self.buffer_length = max(len(s) for s in self.stop) - 1 if self.stop and not self.include_stop else 0
        self.token_ids: list[int] = []
        self.text = ""
        self.stop_reason: str | int | None = None
        self._sent = 0
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._prompt = list(prompt)
        self._stream = None
        self._added: dict[int, str] = {}
        self._last_special = False
        self._spaces = skip_special_tokens or spaces_between_special_tokens
        if tokenizer is not None and getattr(tokenizer, "backend_tokenizer", None) is not None:
            from tokenizers.decoders import DecodeStream

            self._raw = tokenizer.backend_tokenizer
            self._stream = DecodeStream(ids=self._prompt, skip_special_tokens=skip_special_tokens)
            if not self._spaces:
                self._added = {tid: tok.content for tid, tok in tokenizer.added_tokens_decoder.items()}
                self._spaces = not self._added

    def _decode_next(self, token: int) -> str:
        if self._stream is None:  # a tokenizer without the fast backend: each token's text on its own
            if self._tokenizer is None:
                return ""
            return self._tokenizer.decode([token], skip_special_tokens=self._skip_special)
        try:
            piece = self._stream.step(self._raw, token)
        except Exception as exc:  # vLLM restarts the stream on the tokenizer's invalid-prefix error
            log.warning("detokenizing token %d: %s; restarting the decode stream", token, exc)
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            piece = self._stream.step(self._raw, token)
        if not self._spaces:
            special = self._added.get(token)
            if special is not None and self._last_special:
                piece = special
            self._last_special = special is not None
        return piece or ""

    def update(self, new_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append output tokens (the last one a stop token when `stop_terminated`); returns the stop string
        that matched, if any (the text is then truncated as vLLM truncates it, and tokens after the one
        completing the stop string are dropped)."""
        if not new_ids:
            return None
        skipped = None
        if stop_terminated and not self.include_stop:
            skipped, new_ids = new_ids[-1], new_ids[:-1]
        previous = len(self.token_ids)
        offsets = [len(self.text)] if self.stop else None
        for token in new_ids:
            self.token_ids.append(int(token))
            self.text += self._decode_next(int(token))
            if offsets is not None:
                offsets.append(len(self.text))
        if skipped is not None:
            self.token_ids.append(int(skipped))
            if offsets is not None:
                offsets.append(len(self.text))
        if offsets is None or len(self.token_ids) <= self.min_tokens:
            return None
        check_from = offsets[max(self.min_tokens - previous, 0)]
        found = check_stop_strings(self.text, len(self.text) - check_from, self.stop, self.include_stop)
        if found is None:
            return None
        stop_string, truncate_to = found
        stop_end = len(self.text) if truncate_to == -1 else truncate_to
        if not self.include_stop:
            stop_end += len(stop_string)
        kept = bisect_left(offsets, stop_end, lo=1)
        del self.token_ids[previous + kept:]
        if truncate_to != -1:
            self.text = self.text[:truncate_to]
        self.stop_reason = stop_string
        return stop_string

    def next_text(self, finished: bool) -> str:
        """The text not sent yet, less what may still start a stop string (all of it once finished)."""
        end = len(self.text) - (0 if finished else self.buffer_length)
        if end <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent:end], end
        return piece
