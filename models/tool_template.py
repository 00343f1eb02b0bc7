"""A ChatML chat template that renders `tools` the way Qwen3's own template does, for checkpoints
built without the hub (models/tokenizer.py `build_tokenizer(chat_template=TOOLS_CHAT_TEMPLATE)`).

rlpipe's built-in template (models/tokenizer.py CHAT_TEMPLATE) ignores `tools` and writes a tool
message as its own `tool` turn: the calculator agent is trained and served with it. This variant
is Qwen3's format without its reasoning blocks, so a tiny checkpoint shows the tools path of
`rlpipe serve --tool-call-parser hermes` as a Qwen3 model takes it (engines/tool_check.py):

- with `tools`, the system turn carries them, one JSON object a line inside `<tools></tools>`,
  under Qwen3's instructions (the system message's own content first);
- an assistant message's `tool_calls` follow its content as
  `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>` blocks (the hermes format);
- consecutive `tool` messages share one user turn, each inside `<tool_response></tool_response>`.

Without tools, tool calls and tool messages, it renders exactly as CHAT_TEMPLATE does (the
`{% generation %}` markers included). Qwen3's `<think>` handling is left out: the character
tokenizer has no reasoning tokens.
"""

from __future__ import annotations

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_CLOSING = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)


def _literal(text: str) -> str:
    """`text` as a single-quoted Jinja string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


TOOLS_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}"
    "{{- " + _literal(TOOLS_PREAMBLE) + " -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- " + _literal(TOOLS_CLOSING) + " + '<|im_end|>\n' -}}"
    "{%- elif messages and messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown chat role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- generation -%}"
    "{{- content -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}"
    "{%- set call = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}"
    "{{- call['arguments'] if call['arguments'] is string else (call['arguments'] | tojson) -}}"
    "{{- '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
