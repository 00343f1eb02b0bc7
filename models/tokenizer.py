"""A character-level tokenizer the project builds itself (no hub), with a ChatML chat template.

One token per character of a fixed alphabet (printable ASCII and newline by default), plus the
special tokens `<|endoftext|>` (also the pad token), `<|im_start|>`, `<|im_end|>` and `<unk>` for
characters outside the alphabet. Built with the `tokenizers` library and wrapped as a
`transformers.PreTrainedTokenizerFast`, so `save_pretrained(dir)` writes it beside a checkpoint
and `AutoTokenizer.from_pretrained(dir)` (vLLM, SGLang, `load_tokenizer`) reads it back.

    tok = build_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "1+2="}], add_generation_prompt=True)
"""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END, UNK)

# Printable ASCII (digits, letters, punctuation, space) and newline: 96 characters.
DEFAULT_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
assert set(string.digits + string.ascii_letters + string.punctuation + " \n") <= set(DEFAULT_ALPHABET)

# Qwen-style ChatML (roles system, user, assistant and tool: a tool's reply is its own turn). The {% generation %} markers let transformers return the assistant mask
# (`return_assistant_tokens_mask=True`): assistant content and its <|im_end|> are trained on.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown chat role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

MAX_VOCAB = 128


def build_tokenizer(alphabet: str = DEFAULT_ALPHABET, chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A character-level tokenizer over `alphabet` (ids: specials 0..3, then characters in order),
    with `chat_template` (default CHAT_TEMPLATE, which ignores `tools`; models/tool_template.py
    TOOLS_CHAT_TEMPLATE renders them as Qwen3 does).

    Raises ValueError if the alphabet repeats a character or the vocabulary would reach 128.
    """
    if len(set(alphabet)) != len(alphabet):
        dup = sorted({c for c in alphabet if alphabet.count(c) > 1})
        raise ValueError(f"alphabet repeats characters {dup!r}")
    if len(alphabet) + len(SPECIAL_TOKENS) > MAX_VOCAB:
        raise ValueError(
            f"alphabet of {len(alphabet)} characters makes a vocabulary over {MAX_VOCAB} tokens"
        )
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own pre-token ([\s\S] also matches newline); special tokens are
    # matched before this split, so "<|im_end|>" stays one token.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=chat_template,
        model_max_length=4096,
        padding_side="left",  # generation pads on the left
        clean_up_tokenization_spaces=False,
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer (and its chat template) saved in a checkpoint folder or a hub id's snapshot
    (models/loading.py `resolve_model_path`), via AutoTokenizer.

    Raises ValueError if the folder does not exist or holds no tokenizer files.
    """
    from rlpipe.models.loading import resolve_model_path

    try:
        path = resolve_model_path(path)
    except ValueError as error:
        raise ValueError(f"tokenizer: {error}") from None
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(
            f"no tokenizer in {str(path)!r} (expected tokenizer.json or tokenizer_config.json)"
        )
    return AutoTokenizer.from_pretrained(str(path))
