"""Environments for RL: multi-turn conversations with tools, games and graders.

Tool calls in the chat template's format are in tool_calls.py.
"""

from tidal.rl.envs.tool_calls import (
    ToolCall,
    check_arguments,
    check_tool_specs,
    hermes_system_block,
    parse_tool_calls,
    prepare_messages,
    render_chat,
    tool_format,
)

__all__ = [
    "ToolCall",
    "check_arguments",
    "check_tool_specs",
    "hermes_system_block",
    "parse_tool_calls",
    "prepare_messages",
    "render_chat",
    "tool_format",
]
