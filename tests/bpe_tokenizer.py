"""A byte-level BPE tokenizer with Qwen3's chat template, built locally for tests (no hub).

Same shape as Qwen3's tokenizer: Qwen's pre-tokenizer regex, byte-level BPE, `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>` as special tokens and `<think>`, `</think>`, `<tool_call>`, ... as
added (non-special) tokens; the chat template is tests/fixtures/qwen3_chat_template.jinja, which
drops the `<think>` blocks of assistant turns before the last user query.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_chat_template.jinja").read_text()
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2/Qwen3's pre-tokenizer pattern
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "user\nWhat is 12+30? Use the calculator.\nassistant\nThe answer is 42.\n",
    "system\nYou are a helpful assistant.\nuser\nHello there, how are you today?\n",
    "Let me think about it step by step. First add the tens, then the ones.\n\n",
    '{"name": "calculator", "arguments": {"expression": "12+30"}}\n',
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - * / = ( )\n",
] * 20


@cache
def _core() -> str:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS, trainer)
    return core.to_str()


def build_qwen3_like_tokenizer(chat_template: str = QWEN3_TEMPLATE) -> PreTrainedTokenizerFast:
    """A fresh byte-level BPE tokenizer (vocabulary ~430) with `chat_template`."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_core()),
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=chat_template, clean_up_tokenization_spaces=False,
    )
    tok.add_tokens(ADDED)
    return tok
