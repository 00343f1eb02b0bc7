"""The project's character tokenizer: round trip, specials, chat template, save/reload."""

from __future__ import annotations

import pytest
from rlpipe.models.tokenizer import EOS, IM_END, IM_START, UNK, build_tokenizer, load_tokenizer
from transformers import AutoTokenizer

TEXT = "12+34=46\nWhat is (7*8)/2? Answer: 28.  Done!"
CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
]


def test_round_trip_one_token_per_character():
    tok = build_tokenizer()
    ids = tok(TEXT)["input_ids"]
    assert len(ids) == len(TEXT)
    assert tok.decode(ids) == TEXT
    assert len(tok) < 128


def test_special_tokens():
    tok = build_tokenizer()
    assert tok.eos_token == EOS and tok.pad_token == EOS and tok.pad_token_id == tok.eos_token_id
    ids = tok(f"{IM_START}user\nhi{IM_END}")["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(IM_START)
    assert ids[-1] == tok.convert_tokens_to_ids(IM_END)
    assert len(ids) == 2 + len("user\nhi")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_unknown_characters_map_to_unk():
    tok = build_tokenizer()
    ids = tok("a€b")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids(UNK), tok.convert_tokens_to_ids("b")]


def test_custom_alphabet_and_its_errors():
    tok = build_tokenizer("0123456789+=")
    assert len(tok) == 4 + 12
    assert tok.decode(tok("12+3=15")["input_ids"]) == "12+3=15"
    with pytest.raises(ValueError, match="repeats"):
        build_tokenizer("aab")
    with pytest.raises(ValueError, match="128"):
        build_tokenizer("".join(chr(c) for c in range(200, 400)))


def test_chat_template_chatml():
    tok = build_tokenizer()
    text = tok.apply_chat_template(CHAT, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou add numbers.<|im_end|>\n"
        "<|im_start|>user\n1+2=<|im_end|>\n"
        "<|im_start|>assistant\n3<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n")
    # the prompt is a prefix of the full conversation: incremental tokenisation is exact
    assert text.startswith(prompt)


def test_chat_template_assistant_mask():
    tok = build_tokenizer()
    out = tok.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == "3" + IM_END


def test_chat_template_rejects_unknown_role():
    tok = build_tokenizer()
    with pytest.raises(Exception, match="unknown chat role: function"):
        tok.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)
    # a tool's reply is a turn of its own
    text = tok.apply_chat_template([{"role": "tool", "content": "42"}], tokenize=False)
    assert text == "<|im_start|>tool\n42<|im_end|>\n"


def test_save_and_reload_identically(tmp_path):
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    for again in (AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)):
        assert again(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
        assert again.decode(tok(TEXT)["input_ids"]) == TEXT
        assert again.get_vocab() == tok.get_vocab()
        assert (again.eos_token_id, again.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
        assert again.apply_chat_template(CHAT, tokenize=False) == tok.apply_chat_template(CHAT, tokenize=False)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer(tmp_path)
