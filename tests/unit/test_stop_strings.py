"""Stop strings over hostile token sequences: bytes of UTF-8 characters split across tokens, lone
continuation bytes, truncated characters, literal U+FFFD, special tokens, and stop strings that
hold U+FFFD or span token boundaries. Streamed (token by token, as engines/streaming.py sends)
and not streamed (engines/openai_output.py `finish`), for a byte-level BPE (Qwen3's kind) and a
byte-fallback BPE (Llama's kind): both are equal, no prefix of the deltas is ever anything but a
prefix of the answer, and both equal an oracle that cuts the whole decoded text wherever the
tokenizer's whole decoding is what its incremental decoding gives (always for byte-level BPE; a
byte-fallback decoder turns a whole run of byte tokens into U+FFFD once one byte of it is
invalid, rewriting characters a stream has already sent, so there the incremental text rules)."""

from __future__ import annotations

import asyncio
import random

from rlpipe.engines.base import Completion
from rlpipe.engines.openai_output import finish
from rlpipe.engines.protocol import CompletionRequest
from rlpipe.engines.streaming import ChoiceStream, completion_chunks, replay_events
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from tests.bpe_tokenizer import build_qwen3_like_tokenizer

HOSTILE_BYTES = [0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0xEF, 0xBF, 0xBD, 0xC3, 0xA9, 0xFF,
                 ord("a"), ord("b"), ord(" ")]
STOPS = ["\ufffd", "a\ufffd", "\ufffd\ufffd", "\ufffda", "中", "ab", "é", " ", "b中a"]


def _byte_level_ids(tok) -> dict[int, int]:
    """Byte -> token id of a byte-level BPE (GPT-2's byte-to-unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    vocab = tok.get_vocab()
    return {b: vocab[chars[b]] for b in range(256)}


def _byte_fallback_tokenizer() -> tuple[PreTrainedTokenizerFast, dict[int, int]]:
    """A Llama-style BPE: `▁` for spaces, `<0xNN>` byte tokens for what the vocabulary lacks."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "a", "b", "▁a", "ab", "中", "é"]:
        vocab[piece] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b")], byte_fallback=True,
                                unk_token="<unk>", fuse_unk=True))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  clean_up_tokenization_spaces=False)
    return tok, {b: 3 + b for b in range(256)}


def _hostile_ids(rng: random.Random, tok, byte_ids: dict[int, int]) -> list[int]:
    whole = tok("中a é ab", add_special_tokens=False)["input_ids"]
    specials = [tok.eos_token_id, tok.convert_tokens_to_ids(tok.all_special_tokens[0])]
    ids: list[int] = []
    for _ in range(rng.randint(1, 14)):
        r = rng.random()
        if r < 0.7:
            ids.append(byte_ids[rng.choice(HOSTILE_BYTES)])
        elif r < 0.85:
            start = rng.randrange(len(whole))
            ids.extend(whole[start:start + rng.randint(1, 3)])
        else:
            ids.append(rng.choice(specials))
    return ids


def _oracle(tok, ids: list[int], stops: tuple[str, ...], skip: bool, include: bool):
    """The whole decoded text cut at the stop string that ends first (then starts first); the
    tokens through the first whose decoded prefix holds the text through it and does not end in
    a partial character (or all of them), found one by one."""
    text = tok.decode(ids, skip_special_tokens=skip)
    hits = [(text.find(s), s) for s in stops if s in text]
    if not hits:
        return text, len(ids), None
    at, stop = min(hits, key=lambda hit: (hit[0] + len(hit[1]), hit[0]))
    end = at + len(stop)
    prefixes = [tok.decode(ids[:k], skip_special_tokens=skip) for k in range(len(ids) + 1)]
    keep = next(k for k, decoded in enumerate(prefixes) if decoded.startswith(text[:end])
                and (k == len(ids) or not decoded.endswith("\ufffd")))
    return (text[:end] if include else text[:at]), keep, stop


def _streamed(tok, ids, stops, skip, include):
    stream = ChoiceStream(tok, stops, (), skip, include)
    deltas = []
    for token in ids:
        deltas.append(stream.add(token, -1.0))
        if stream.done is not None:
            break
    else:
        deltas.append(stream.close("length"))
    return deltas, stream.done


def test_streamed_and_whole_answers_cut_hostile_tokens_as_the_oracle_does():
    rng = random.Random(7)
    qwen = build_qwen3_like_tokenizer()
    for tok, byte_ids in ((qwen, _byte_level_ids(qwen)), _byte_fallback_tokenizer()):
        cut = checked = 0
        for _ in range(400):
            ids = _hostile_ids(rng, tok, byte_ids)
            stops = tuple(rng.sample(STOPS, rng.randint(1, 3)))
            skip, include = rng.random() < 0.5, rng.random() < 0.3
            text, keep, stop = _oracle(tok, ids, stops, skip, include)
            whole = finish(Completion(ids, [-1.0] * len(ids), "length"), tok, stops, (),
                           skip_special_tokens=skip, include_stop=include)
            deltas, done = _streamed(tok, ids, stops, skip, include)
            case = (ids, stops, skip, include, deltas, text)
            assert whole == done and whole.text == "".join(deltas), case
            for k in range(len(deltas)):  # nothing past the stop, no character the answer lacks
                assert whole.text.startswith("".join(deltas[:k + 1])), case
            uncut = finish(Completion(ids, [-1.0] * len(ids), "length"), tok, (), (), skip_special_tokens=skip)
            if uncut.text != tok.decode(ids, skip_special_tokens=skip):
                assert tok is not qwen, case
                continue
            assert whole.text == text and whole.tokens == ids[:keep] and whole.stop_reason == stop, case
            assert whole.finish_reason == ("stop" if stop else "length"), case
            checked += 1
            cut += stop is not None
        assert checked > 300 and cut > 100  # the oracle is met, and the stop strings are reached


def test_a_stop_string_of_replacement_characters_cuts_a_stream_that_ends_on_them():
    """The stream's last bytes are a truncated character: its U+FFFD becomes final only when the
    completion ends, and the stop string that holds it still cuts (it was sent before the fix)."""
    tok = build_qwen3_like_tokenizer()
    byte_ids = _byte_level_ids(tok)
    ids = [byte_ids[ord("x")], byte_ids[ord("a")], byte_ids[0xE4]]
    deltas, done = _streamed(tok, ids, ("a\ufffd",), True, False)
    assert "".join(deltas) == done.text == "x" and done.stop_reason == "a\ufffd"
    # a partial character that a later byte completes never matches a stop string
    ids = [byte_ids[b] for b in "中".encode()]
    deltas, done = _streamed(tok, ids, ("\ufffd",), True, False)
    assert "".join(deltas) == "中" and done.finish_reason == "length"
    assert finish(Completion(ids, [-1.0] * 3, "length"), tok, ("\ufffd",), ()).text == "中"


def test_the_served_stream_chunks_add_up_to_the_whole_answer():
    """Through the /v1/completions chunk maker: text, token ids, finish_reason and stop_reason
    per choice."""
    tok = build_qwen3_like_tokenizer()
    byte_ids = _byte_level_ids(tok)
    rng = random.Random(3)
    stops = ["a\ufffd", "b中a"]
    req = CompletionRequest(prompt="x", stop=stops, n=8, stream=True)
    group = [Completion(ids, [-0.5] * len(ids), "length") for ids in
             (_hostile_ids(rng, tok, byte_ids) for _ in range(8))]

    async def chunks():
        return [c async for c in completion_chunks(replay_events([group], None), {}, tok, req, 8, 1)]

    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    ends: dict[int, tuple] = {}
    for chunk in asyncio.run(chunks()):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
            if choice["finish_reason"] is not None:
                ends[choice["index"]] = (choice["finish_reason"], choice["stop_reason"])
    for j, completion in enumerate(group):
        whole = finish(completion, tok, tuple(stops), ())
        assert texts.get(j, "") == whole.text and ends[j] == (whole.finish_reason, whole.stop_reason)
        assert ids[j] == whole.tokens  # no token id past the one that completed the stop string
    assert {reason for reason, _ in ends.values()} == {"stop", "length"}


def test_the_served_chat_stream_deltas_add_up_to_the_whole_answer():
    """Through the /v1/chat/completions chunk maker: content, token ids and the finish per choice."""
    from rlpipe.engines.chat_api import ChatRequest
    from rlpipe.engines.streaming import chat_chunks

    tok = build_qwen3_like_tokenizer()
    byte_ids = _byte_level_ids(tok)
    rng = random.Random(5)
    stops = ["\ufffd\ufffd", "é", "b中a"]
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], stop=stops, n=8, stream=True)
    group = [Completion(ids, [-0.5] * len(ids), "length") for ids in
             (_hostile_ids(rng, tok, byte_ids) for _ in range(8))]

    async def chunks():
        return [c async for c in chat_chunks(replay_events([group], None), {}, tok, req, 1)]

    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    ends: dict[int, tuple] = {}
    for chunk in asyncio.run(chunks()):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["delta"].get("content", "")
            ids.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
            if choice["finish_reason"] is not None:
                ends[choice["index"]] = (choice["finish_reason"], choice["stop_reason"])
    for j, completion in enumerate(group):
        whole = finish(completion, tok, tuple(stops), ())
        assert (texts[j], ids[j], ends[j]) == (whole.text, whole.tokens, (whole.finish_reason, whole.stop_reason))
    assert {reason for reason, _ in ends.values()} == {"stop", "length"}
