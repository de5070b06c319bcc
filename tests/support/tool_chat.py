"""What the tool-calling tests of the chat and Responses endpoints share: a chat template of our own
(``--chat-template``) that renders tools, earlier tool calls and results and Qwen3's think block,
two tools with bounded schemas, and a forced answer with reasoning and a hermes tool call."""

from __future__ import annotations

from typing import Any

TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool.function.name }} {% endfor %}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for call in m.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False, "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
FORCED = ('<think>I should look it up.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "days": 2}}\n</tool_call>')
