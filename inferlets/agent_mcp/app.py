"""agent_mcp: an agent whose tools are an MCP server's, called from inside the sandbox.

It connects to `--server URL` (MCP's streamable HTTP transport, through the WIT `http` import: the
operator must allow the server's host with `--http-allow`), lists the server's tools, and lets the
model call them: each turn the model writes either an answer or a Hermes call
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), drawn under a grammar that admits only
the listed tools with arguments of their input schemas; the inferlet calls the tool on the server
and fills its result into the same context (its KV is kept: no re-prefill, no client round trip).
`--tool-choice required` makes the first turn a call; `--call NAME --arguments JSON` calls a tool
directly before the model answers.

    pie-run --http-allow 127.0.0.1:8000 agent_mcp -- --server http://127.0.0.1:8000/mcp --task "Add 2 and 3"

Returns the final answer; with --json, {"answer", "tools", "calls": [{"name", "arguments", "result"}]}.
"""

from __future__ import annotations

import json

from inferlet import ArgumentParser, Context, InferletError, Sampler, get_model, grammar, send
from inferlet.mcp import McpClient, McpError
from inferlet.sampler import AnyOf, MaxTokens, UntilTokens
from inferlet.toolcalls import auto_grammar, chat_messages, parse_calls


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="agent_mcp", description="An agent calling an MCP server's tools from the sandbox.")
    p.add_argument("--server", required=True, help="the MCP endpoint, e.g. http://127.0.0.1:8000/mcp")
    p.add_argument("--header", action="append", default=[], help="NAME:VALUE sent to the server (repeatable)")
    p.add_argument("--task", default="Use a tool to help answer: what is 2 plus 3?")
    p.add_argument("--max-turns", type=int, default=4, help="tool calls at most (4)")
    p.add_argument("-n", "--max-tokens", type=int, default=96, help="most tokens per turn (96)")
    p.add_argument("--tool-choice", default="auto", choices=["auto", "required"])
    p.add_argument("--call", default=None, help="call this tool first, with --arguments")
    p.add_argument("--arguments", default="{}", help="JSON arguments of --call")
    p.add_argument("--json", action="store_true", help="return the answer, the tools and the calls as JSON")
    return p


PARSER = parser()


def call_tool(client: McpClient, name: str, arguments: dict, calls: list[dict]) -> str:
    try:
        result = client.call_tool_text(name, arguments)
    except McpError as e:
        result = f"error: {e}"
    calls.append({"name": name, "arguments": arguments, "result": result})
    send(json.dumps({"type": "tool_result", "name": name, "result": result}))
    return result


def main(args: list[str]) -> str | None:
    opts = PARSER.parse(args)
    headers = dict(h.split(":", 1) for h in opts.header if ":" in h)
    model = get_model()
    calls: list[dict] = []
    with McpClient(opts.server, headers=headers) as client:
        tools = [t.openai() for t in client.list_tools()]
        if not tools:
            raise InferletError(f"the MCP server at {opts.server} lists no tools")
        messages: list[dict] = [{"role": "user", "content": opts.task}]
        if opts.call is not None:
            arguments = json.loads(opts.arguments)
            result = call_tool(client, opts.call, arguments, calls)
            messages += [{"role": "assistant", "content": "", "tool_calls": [
                {"id": "call-0", "type": "function", "function": {"name": opts.call, "arguments": arguments}}]},
                {"role": "tool", "content": result}]
        stop = AnyOf(MaxTokens(opts.max_tokens), UntilTokens(model.stop_tokens))
        answer = ""
        with Context(model) as ctx:
            ctx.fill_chat(chat_messages(messages, tools, False))
            for turn in range(opts.max_turns + 1):
                forced = opts.tool_choice == "required" and turn == 0 and not calls
                rule = grammar.lark(auto_grammar(tools, False)) if turn < opts.max_turns else None
                if forced:
                    rule = grammar.lark(auto_grammar(tools, False).replace("start: TEXT | call", "start: call"))
                text = ctx.generate(Sampler.greedy(), stop=stop, grammar=rule)
                answer, found = parse_calls(text, tools)
                if not found:
                    break
                results = []
                for c in found:
                    fn = c["function"]
                    results.append(call_tool(client, fn["name"], json.loads(fn["arguments"] or "{}"), calls))
                # the results as the next user turn (Hermes' tool_response form), into the same context
                ctx.fill_chat(chat_messages([{"role": "tool", "content": r} for r in results], None, False))
    if opts.json:
        return json.dumps({"answer": answer, "tools": [t["function"]["name"] for t in tools], "calls": calls})
    return answer
