"""Tool calls in the chat template's format: parsing what the model wrote (never raising),
rendering specs, calls and results with the built-in ChatML and with a template that reads
`tools`, and the error for a template without tool support."""

import json

import pytest

from tidal.rl.envs.tool_calls import (
    ToolCall,
    check_tool_specs,
    parse_tool_calls,
    prepare_messages,
    render_chat,
    tool_format,
)
from tidal.rl.tools import make_tool
from tidal.train.data.chat import BUILTIN_TEMPLATE, ChatTemplate

CALC = make_tool("calc").spec()
PYTHON = make_tool("python").spec()
TOOLS = [CALC, PYTHON]

# A reduced Qwen 2.5 template: it reads `tools` and renders tool turns its own way.
QWEN_LIKE = """\
{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}Be helpful.{% endif %}
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}{% for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA2_LIKE = """\
{% for message in messages %}{% if message['role'] not in ['user', 'assistant'] %}\
{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}\
[{{ message['role'] }}] {{ message['content'] }}
{% endfor %}"""

DROPS_TOOL = """\
{% for message in messages %}{% if message['role'] in ['user', 'assistant'] %}\
[{{ message['role'] }}] {{ message['content'] }}
{% endif %}{% endfor %}"""


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# -- parsing ----------------------------------------------------------------------------------


def test_parses_calls_and_content():
    text = (
        "Let me compute.\n"
        + call("calc", expression="2 ** 10")
        + "\n"
        + call("python", code="print(1)")
    )
    content, calls, errors = parse_tool_calls(text, TOOLS)
    assert content == "Let me compute."
    assert errors == []
    assert calls == [
        ToolCall("calc", {"expression": "2 ** 10"}, 0),
        ToolCall("python", {"code": "print(1)"}, 1),
    ]
    assert parse_tool_calls("just text #### 4", TOOLS) == ("just text #### 4", [], [])


def test_openai_forms_are_read():
    # arguments as a JSON string (OpenAI) and "parameters" (Llama) are accepted
    text = '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    _, calls, errors = parse_tool_calls(text, TOOLS)
    assert errors == [] and calls[0].arguments == {"expression": "1+1"}
    _, calls, _ = parse_tool_calls(
        '<tool_call>{"name": "calc", "parameters": {"expression": "3"}}</tool_call>'
    )
    assert calls[0].arguments == {"expression": "3"}
    out = calls[0].openai()
    assert out["type"] == "function" and json.loads(out["function"]["arguments"]) == {
        "expression": "3"
    }


def test_unterminated_call_is_read_when_complete():
    _, calls, errors = parse_tool_calls(
        '<tool_call>{"name": "calc", "arguments": {"expression": "5"}}', TOOLS
    )
    assert calls == [ToolCall("calc", {"expression": "5"}, 0)] and errors == []
    _, calls, errors = parse_tool_calls('ok <tool_call>{"name": "calc", "argu', TOOLS)
    assert calls == [] and len(errors) == 1 and "not valid JSON" in errors[0]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<tool_call>{name: calc}</tool_call>", "tool call 1 is not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", 'string "name"'),
        ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
        (
            '<tool_call>{"name": "search", "arguments": {}}</tool_call>',
            "unknown tool 'search'; the tools are ['calc', 'python']",
        ),
        (
            '<tool_call>{"name": "calc", "arguments": {}}</tool_call>',
            "missing required argument(s) ['expression']",
        ),
        (
            '<tool_call>{"name": "calc", "arguments": {"expression": 3}}</tool_call>',
            "'expression' must be of type string, got int",
        ),
        (
            '<tool_call>{"name": "calc", "arguments": [1]}</tool_call>',
            '"arguments" must be a JSON object, got list',
        ),
        (
            '<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>',
            "its arguments are not valid JSON",
        ),
        ("<tool_call>" + "[" * 100_000 + "</tool_call>", "not valid JSON"),
        ("<tool_call></tool_call>", "not valid JSON"),
    ],
)
def test_malformed_calls_are_errors_not_exceptions(text, message):
    content, calls, errors = parse_tool_calls("before " + text + " after", TOOLS)
    assert calls == [] and len(errors) == 1
    assert errors[0].startswith("Tool error: tool call 1")
    assert message in errors[0]
    assert content == "before  after"


def test_errors_keep_their_position():
    text = (
        call("calc", expression="1") + "<tool_call>nope</tool_call>" + call("calc", expression="2")
    )
    _, calls, errors = parse_tool_calls(text, TOOLS)
    assert [c.index for c in calls] == [0, 2]
    assert errors[0].startswith("Tool error: tool call 2 ")


def test_hostile_text_never_raises():
    for text in [
        "",
        "</tool_call>",
        "<tool_call>",
        "<tool_call><tool_call>{}",
        "\x00" * 10,
        "<tool_call>1e999999</tool_call>",
    ]:
        content, calls, errors = parse_tool_calls(text, TOOLS)
        assert isinstance(content, str) and calls == []


def test_tool_specs_are_checked():
    assert check_tool_specs(TOOLS) == TOOLS
    with pytest.raises(ValueError, match=r"tools\[1\] must be an object"):
        check_tool_specs([CALC, {"name": "x"}])
    with pytest.raises(ValueError, match="listed twice"):
        check_tool_specs([CALC, CALC])
    with pytest.raises(ValueError, match="non-empty string"):
        check_tool_specs([{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="must be a list"):
        check_tool_specs(CALC)


# -- rendering --------------------------------------------------------------------------------


CONVERSATION = [
    {"role": "user", "content": "What is 2**10?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calc", "arguments": '{"expression": "2**10"}'},
            }
        ],
    },
    {"role": "tool", "content": "1024"},
]


def test_builtin_template_writes_hermes():
    template = ChatTemplate(BUILTIN_TEMPLATE, name="builtin")
    assert not template.declares_tools and tool_format(template) == "hermes"
    text = render_chat(template, CONVERSATION, [CALC])
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(CALC) in text.split("<tools>\n")[1].split("</tools>")[0]
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calc", "arguments": {"expression": "2**10"}}\n</tool_call><|im_end|>' in text
    )
    assert (
        "<|im_start|>tool\n<tool_response>\n1024\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        in text
    )
    # a system message of the user's comes first, then the tool block
    text = render_chat(
        template, [{"role": "system", "content": "Be brief."}, *CONVERSATION], [CALC]
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    # without tools the template renders as ever
    plain = [{"role": "user", "content": "Hi"}]
    assert render_chat(template, plain) == template.render(plain, add_generation_prompt=True)


def test_template_with_tools_renders_them_itself():
    template = ChatTemplate(QWEN_LIKE, name="qwen-like")
    assert template.declares_tools and tool_format(template) == "template"
    text = render_chat(template, CONVERSATION, [CALC])
    assert text.startswith("<|im_start|>system\nBe helpful.")
    assert "<tools>\n" + json.dumps(CALC) + "\n</tools>" in text
    assert (
        '{"name": "calc", "arguments": {"expression": "2**10"}}' in text
    )  # arguments as an object
    assert "<|im_start|>user\n<tool_response>\n1024\n</tool_response><|im_end|>" in text
    assert "# Tools" not in text


def test_prepare_messages_copies():
    before = json.dumps(CONVERSATION)
    prepare_messages(CONVERSATION, [CALC], "hermes")
    prepare_messages(CONVERSATION, [CALC], "template")
    assert json.dumps(CONVERSATION) == before


@pytest.mark.parametrize(
    ("source", "why"), [(LLAMA2_LIKE, "cannot render"), (DROPS_TOOL, "drops system or tool")]
)
def test_template_without_tool_support_is_a_clear_error(source, why):
    template = ChatTemplate(source, name="mytemplate.jinja")
    with pytest.raises(
        ValueError, match=f"chat template mytemplate.jinja has no tool support.*{why}"
    ):
        tool_format(template)
    with pytest.raises(ValueError, match="no tool support"):
        render_chat(template, [{"role": "user", "content": "Hi"}], [CALC])
