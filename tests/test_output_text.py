"""OutputText (a choice's text as vLLM's front end makes it) against a plain reference that decodes the
whole output at once and finds the earliest stop string after min_tokens, on seeded random outputs
cut into random updates; a stream's pieces join to the whole text and never send what a stop string
later cuts. vLLM's own detokenizer on the same inputs: tests/vllm/check_parity.py."""
from __future__ import annotations

import random

import pytest

from dwdp.serve.output_text import OutputText

from front_stubs import tiny_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def reference(tokenizer, prompt, output, *, stop=(), min_tokens=0, include=False, skip_special=True,
              stop_terminated=False):
    """(token ids, text, stop string) of `output` decoded whole: the text after the prompt's, the earliest
    ending stop string that ends past the first min_tokens tokens' text, truncated as vLLM does."""
    def text_of(ids):
        full = tokenizer.decode(prompt + ids, skip_special_tokens=skip_special)
        return full[len(tokenizer.decode(prompt, skip_special_tokens=skip_special)):]

    shown = output[:-1] if stop_terminated and not include else output
    offsets = [len(text_of(shown[:k])) for k in range(len(shown) + 1)]
    text = offsets and text_of(shown)
    if stop_terminated and not include:
        offsets.append(offsets[-1])
    if not stop or len(output) <= min_tokens:
        return list(output), text, None
    boundary = offsets[min(min_tokens, len(offsets) - 1)]
    best = None
    for s in stop:
        start = text.find(s)
        while start != -1:
            end = start + len(s)
            if end > boundary and (best is None or end < best[1]):
                best = (s, end, start)
            start = text.find(s, start + 1)
    if best is None:
        return list(output), text, None
    s, end, start = best
    kept = next(k for k in range(1, len(offsets)) if offsets[k] >= end)
    return list(output[:kept]), (text[:end] if include else text[:start]), s


def _case(rng: random.Random, with_stop_token: bool):
    prompt = [rng.randrange(4, 512) for _ in range(rng.randrange(1, 6))]
    vocab = [rng.randrange(4, 40) for _ in range(6)] + [0, 1, 3]  # few words: stop strings recur; specials
    output = [rng.choice(vocab) for _ in range(rng.randrange(1, 14))]
    if with_stop_token:
        output.append(EOS)
    return prompt, output


def _stop_strings(rng, tokenizer, prompt, output) -> list[str]:
    text = tokenizer.decode(prompt + output, skip_special_tokens=True)
    stops = []
    for _ in range(rng.randrange(1, 3)):
        start = rng.randrange(0, max(len(text) - 1, 1))
        stops.append(text[start:start + rng.randrange(1, 9)] or "w")
    return stops


def _run(tokenizer, prompt, output, updates, **options):
    stop_terminated = options.pop("stop_terminated")
    out = OutputText(tokenizer, prompt, **options)
    sent, i = "", 0
    for n in updates:
        chunk = output[i:i + n]
        i += n
        last = i >= len(output)
        matched = out.update(chunk, stop_terminated=stop_terminated and last)
        sent += out.next_text(matched is not None or last)
        if matched is not None:
            break
    return out, sent


@pytest.mark.parametrize("seed", range(40))
def test_output_text_equals_the_whole_decode_reference_however_the_updates_are_cut(tokenizer, seed):
    rng = random.Random(seed)
    stop_token = seed % 3 == 0
    prompt, output = _case(rng, stop_token)
    options = dict(stop=_stop_strings(rng, tokenizer, prompt, output) if seed % 4 else [],
                   min_tokens=rng.choice([0, 0, 1, 3]), include_stop_str_in_output=seed % 5 == 0,
                   skip_special_tokens=seed % 7 != 0)
    want = reference(tokenizer, prompt, output, stop=options["stop"], min_tokens=options["min_tokens"],
                     include=options["include_stop_str_in_output"], skip_special=options["skip_special_tokens"],
                     stop_terminated=stop_token)
    for cut in range(3):  # one token at a time, then two random cuts
        updates, left = [], len(output)
        while left:
            n = 1 if cut == 0 else rng.randrange(1, left + 1)
            updates.append(n)
            left -= n
        out, sent = _run(tokenizer, prompt, output, updates, stop_terminated=stop_token, **options)
        assert (out.token_ids, out.text, out.stop_reason) == want, (prompt, output, options, updates)
        assert sent == out.text, ("a stream's pieces do not join to its text", sent, out.text)


def test_a_stream_holds_back_what_may_still_start_a_stop_string(tokenizer):
    out = OutputText(tokenizer, [5], stop=["w9 w10 w11"])
    assert out.update([9]) is None and out.next_text(False) == ""  # " w9" may start the stop string
    assert out.update([10]) is None and out.next_text(False) == ""
    assert out.update([12]) is None and out.next_text(False) == " w"  # the last len(stop) - 1 = 9 held
    assert out.next_text(True) == "9 w10 w12" and out.text == " w9 w10 w12"


def test_a_stop_string_within_the_first_min_tokens_is_not_matched_but_one_ending_after_is(tokenizer):
    out = OutputText(tokenizer, [5], stop=["w9 w10"], min_tokens=1)
    assert out.update([9]) is None
    assert out.update([10]) == "w9 w10" and out.text == " " and out.token_ids == [9, 10]
    out = OutputText(tokenizer, [5], stop=["w9"], min_tokens=1)
    assert out.update([9]) is None and out.update([10]) is None and out.text == " w9 w10"


def test_spaces_between_special_tokens_off_joins_adjacent_special_tokens(tokenizer):
    ids = [9, 3, 1, 10]
    spaced = OutputText(tokenizer, [5], skip_special_tokens=False)
    spaced.update(ids)
    joined = OutputText(tokenizer, [5], skip_special_tokens=False, spaces_between_special_tokens=False)
    joined.update(ids)
    assert spaced.text == " w9 [UNK] [BOS] w10", spaced.text
    assert joined.text == " w9 [UNK][BOS] w10", joined.text


def test_without_a_tokenizer_there_is_no_text_but_every_token_counts():
    out = OutputText(None, [5], stop=["x"])
    assert out.update([9, 10]) is None and out.text == "" and out.token_ids == [9, 10]
