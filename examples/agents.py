"""The agent inferlets on the embedded host: `python examples/agents.py`.

* agent_react with a client-side tool answered by this script,
* agent_codeact running a code block from the task inside its sandbox,
* agent_swarm as four instances chained by publish/subscribe.
"""

from __future__ import annotations

import json
import uuid

from _common import finish, launch, make_host, run, show


def main() -> None:
    host = make_host()
    try:
        def answer_tool(iid: str, message: str) -> None:
            msg = json.loads(message)
            print("   client got:", msg)
            if msg.get("type") == "tool_call":  # our client-side tool: answer the user's question
                host.signal(iid, "I live in Berlin.")

        _iid, events = launch(host, "agent_react", [
            "--question", "Which country's capital does the user live in?", "--tool-choice", "ask_user,lookup,auto",
            "--max-turns", "3", "--json"], on_message=answer_tool, close_input=False)
        show("agent_react", finish(events))

        task = "What does this print?\n```python\nprint([n for n in range(2, 30) if all(n % d for d in range(2, n))])\n```"
        show("agent_codeact", run(host, "agent_codeact", ["--task", task, "--json"]))

        swarm = uuid.uuid4().hex
        runs = [launch(host, "agent_swarm", ["--swarm", swarm, "--role", str(i), "--max-tokens", "32"])
                for i in range(4)]
        results = [finish(ev) for _iid, ev in runs]
        show("agent_swarm (the editor's final answer)", results[-1])
    finally:
        host.shutdown()


if __name__ == "__main__":
    main()
