"""A request shaped like the ones Claude Code sends to `ANTHROPIC_BASE_URL`.

Headers, query and body follow what Claude Code 2.x sends for a turn of its main loop:
`POST /v1/messages?beta=true` with `x-api-key`, `anthropic-version: 2023-06-01`, several
`anthropic-beta` flags and its client headers; a body with `system` as text blocks with
`cache_control`, 24 client tools (its built-in ones and MCP tools, JSON schemas of draft
07), `thinking`, `context_management`, `output_config`, `metadata.user_id`,
`max_tokens: 32000`, `temperature: 1`, `stream: true`, and a user turn of text blocks
(a system reminder and the request), about 77 KB in all. The texts are filler of the
right size; the shapes are what matters to the episode plane.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["BETAS", "TOOL_NAMES", "claude_code_body", "claude_code_headers"]

BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,"
         "context-management-2025-06-27,fine-grained-tool-streaming-2025-05-14")
TOOL_NAMES = ("Task", "Bash", "Glob", "Grep", "ExitPlanMode", "Read", "Edit", "Write",
              "NotebookEdit", "WebFetch", "TodoWrite", "WebSearch", "BashOutput", "KillShell",
              "Skill", "SlashCommand", "AskUserQuestion", "ListMcpResourcesTool",
              "ReadMcpResourceTool", "mcp__ide__getDiagnostics", "mcp__ide__executeCode",
              "mcp__github__create_pull_request", "mcp__github__get_issue",
              "mcp__playwright__browser_navigate")
_PROSE = ("Use this tool when the task calls for it. Read the relevant files first, keep "
          "changes minimal, and explain what you did. Never guess at paths: search for "
          "them. Quote paths with spaces. Prefer the dedicated tools over shell commands "
          "for reading, searching and editing files. ")


def _schema(name: str) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "description": {"type": "string", "description": f"What this {name} call does, in "
                                                         "five to ten words"},
        "path": {"type": "string", "description": "The absolute path to act on"},
        "timeout": {"type": "number", "description": "Optional timeout in milliseconds "
                                                     "(max 600000)"},
        "options": {"type": "array", "items": {"type": "object", "properties": {
            "label": {"type": "string"}, "value": {"type": "string"}},
            "required": ["label"], "additionalProperties": False}},
    }
    if name == "Bash":
        properties["command"] = {"type": "string", "description": "The command to execute"}
    return {"type": "object", "properties": properties,
            "required": ["command"] if name == "Bash" else ["path"],
            "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}


def claude_code_body(*, size: int = 77_000, stream: bool = True) -> dict[str, Any]:
    """The body, padded to about `size` bytes of JSON."""
    def body_with(description_chars: int) -> dict[str, Any]:
        prose = (_PROSE * (description_chars // len(_PROSE) + 1))[:description_chars]
        return {
            "model": "claude-sonnet-4-5-20250929",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nAs you answer the user's "
                                         "questions, you can use the following context: "
                                         "# important-instruction-reminders\nDo what has "
                                         "been asked; nothing more, nothing less.\n"
                                         "</system-reminder>\n"},
                {"type": "text", "text": "The test tests/test_parser.py fails; find out why "
                                         "and fix it.",
                 "cache_control": {"type": "ephemeral"}}]}],
            "system": [
                {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for "
                                         "Claude.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "You are an interactive CLI tool that helps users "
                                         "with software engineering tasks. " + prose * 2,
                 "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": name, "description": f"{name}: {prose}",
                       "input_schema": _schema(name)} for name in TOOL_NAMES],
            "metadata": {"user_id": "user_4f1c0e2b9a7d6c5e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e"
                                    "5f4a3b2c1d0e_account__session_0b7f3c2e-5d1a-4e8b-9c6f-"
                                    "2a4d8e1b3c5f"},
            "max_tokens": 32000,
            "thinking": {"type": "enabled", "budget_tokens": 31999},
            "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                              "keep": "all"}]},
            "output_config": {"effort": "high"},
            "temperature": 1,
            "stream": stream,
        }

    # the descriptions grow until the body has the size asked for
    chars = 100
    while len(json.dumps(body_with(chars))) < size:
        chars += 200
    return body_with(chars)


def claude_code_headers(api_key: str) -> dict[str, str]:
    return {
        "x-api-key": api_key,
        "anthropic-version": "2023-06-01",
        "anthropic-beta": BETAS,
        "anthropic-dangerous-direct-browser-access": "true",
        "x-app": "cli",
        "user-agent": "claude-cli/2.0.50 (external, cli)",
        "x-stainless-lang": "js", "x-stainless-package-version": "0.68.0",
        "x-stainless-runtime": "node", "x-stainless-retry-count": "0",
        "x-stainless-timeout": "600",
        "content-type": "application/json", "accept": "application/json",
    }
