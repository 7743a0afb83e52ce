"""agent_react: a ReAct agent (Thought / Action / Observation / Final Answer) whose KV cache is kept.

The transcript lives in one `Context` for the whole run: each turn only the new text (the tool's
observation) is prefilled, never the transcript again. Tools:

  calculator[expr]   arithmetic, evaluated inside the inferlet (+ - * / // % ** and parentheses)
  lookup[words]      the best-matching document among those passed with --doc
  ask_user[question] a client-side tool: the call is sent to the client as a JSON message
                     {"type": "tool_call", "tool": "ask_user", "arg": ..., "turn": n}; the client's
                     next message is the observation ("unavailable" when it sends none in time)
  finish             give the final answer

The tool of each turn is the model's choice among the tool names (their first tokens' probabilities
after "Action:"), or forced with --tool-choice (like a completion API's tool_choice). At most
--max-turns tool calls, then a final answer is forced.

`--stateless` is the baseline of the benchmark: it behaves like a stateless completion API, so every
turn starts a fresh context and re-prefills the whole transcript.

Returns the final answer; with --json, {"answer", "transcript", "turns", "prefill_tokens"}.
"""

from __future__ import annotations

import ast
import json
import operator

from inferlet import ArgumentParser, Context, InferletError, Sampler, UntilText, get_model, receive, send
from inferlet.sampler import AnyOf, MaxTokens, UntilTokens

TOOLS = ("calculator", "lookup", "ask_user", "finish")

DEFAULT_DOCS = [
    "Paris is the capital of France. It has about 2.1 million inhabitants.",
    "The Eiffel Tower in Paris is 330 metres tall and was completed in 1889.",
    "Berlin is the capital of Germany.",
]

SYSTEM = """You are an assistant that answers with tools. Use this format:
Thought: what to do next
Action: calculator[2 * 3] or lookup[keywords] or ask_user[question] or finish
Observation: the tool's result
... (repeat Thought / Action / Observation)
Final Answer: the answer

Example:
Question: How tall is the Eiffel Tower in feet?
Thought: I need the height of the tower.
Action: lookup[Eiffel Tower height]
Observation: The Eiffel Tower in Paris is 330 metres tall and was completed in 1889.
Thought: One metre is 3.28 feet, so I multiply.
Action: calculator[330 * 3.28]
Observation: 1082.4
Thought: I know the answer.
Action: finish
Final Answer: About 1082 feet."""


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="agent_react", description="A ReAct agent with a calculator, a document lookup and a client tool.")  # fmt: skip
    p.add_argument("-q", "--question", default="How many years ago was the Eiffel Tower completed, from 2024?")
    p.add_argument("--doc", action="append", default=None, help="a document for lookup (repeatable)")
    p.add_argument("--max-turns", type=int, default=3, help="most tool calls (3)")
    p.add_argument("--tool-choice", default="auto",
                   help="comma-separated tool per turn (auto|calculator|lookup|ask_user|finish); the last repeats")
    p.add_argument("--thought-tokens", type=int, default=32, help="most tokens per thought (32)")
    p.add_argument("--arg-tokens", type=int, default=16, help="most tokens per tool argument (16)")
    p.add_argument("--answer-tokens", type=int, default=32, help="most tokens in the final answer (32)")
    p.add_argument("--client-timeout-ms", type=int, default=10000, help="wait for the client tool (10000)")
    p.add_argument("--stateless", action="store_true", help="baseline: re-prefill the transcript every turn")
    p.add_argument("--json", action="store_true", help="return a JSON object with the transcript")
    return p


PARSER = parser()

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def calculator(expr: str) -> str:
    """Evaluate an arithmetic expression (numbers and + - * / // % ** only)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)[:40]}")

    try:
        value = ev(ast.parse(expr.replace(",", "").strip(), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float):
        value = round(value, 6)
        if value.is_integer():
            value = int(value)
    return str(value)


def _words(text: str) -> set[str]:
    return {w.strip(".,;:!?()[]\"'").lower() for w in text.split()} - {""}


def lookup(query: str, docs: list[str]) -> str:
    """The document sharing the most words with the query (first on ties)."""
    q = _words(query)
    best, best_n = None, 0
    for d in docs:
        n = len(q & _words(d))
        if n > best_n:
            best, best_n = d, n
    return best if best is not None else "no matching document"


def ask_user(question: str, turn: int, timeout_ms: int) -> str:
    send(json.dumps({"type": "tool_call", "tool": "ask_user", "arg": question, "turn": turn}))
    answer = receive(timeout_ms)
    return "unavailable" if answer is None else answer


class Agent:
    """The transcript and the context holding it (kept, or rebuilt every turn when stateless)."""

    def __init__(self, stateless: bool, prompt: str) -> None:
        self.model = get_model()
        self.stateless = stateless
        self.prompt = prompt  # the chat up to the assistant's generation prompt
        self.text = ""  # the assistant's transcript so far
        self.prefill_tokens = 0
        self.ctx: Context | None = None

    def _context(self) -> Context:
        if self.ctx is None or self.stateless:
            if self.ctx is not None:
                self.ctx.release()
            self.ctx = Context(self.model)
            self._fill(self.prompt + self.text)
        return self.ctx

    def _fill(self, text: str) -> None:
        assert self.ctx is not None
        ids = self.model.encode(text)
        self.prefill_tokens += len(ids)
        self.ctx.fill_tokens(ids)

    def add(self, text: str) -> None:
        """Text written by the inferlet (prefilled at the next pass)."""
        if self.ctx is not None and not self.stateless:
            self._fill(text)
        self.text += text

    def generate(self, until: str, max_tokens: int) -> str:
        """Generate up to `until` (kept) or a stop token; the text joins the transcript."""
        ctx = self._context()
        stop = AnyOf(MaxTokens(max_tokens), UntilText(until), UntilTokens(self.model.stop_tokens))
        out = ctx.generate(Sampler.greedy(), stop=stop)
        self.text += out
        return out

    def choose(self, names: tuple[str, ...]) -> str:
        """The tool name whose first token the model finds most probable next."""
        ids, probs = self._context().next_dist(64)
        prob = dict(zip(ids, probs, strict=False))
        scored = [(prob.get(self.model.encode(" " + n)[0], 0.0), -i, n) for i, n in enumerate(names)]
        return max(scored)[2]

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.release()


def tool_choices(tool_choice: str, max_turns: int) -> list[str]:
    """The --tool-choice entries, checked (with --max-turns)."""
    choices = [c.strip() for c in tool_choice.split(",") if c.strip()]
    for c in choices:
        if c != "auto" and c not in TOOLS:
            raise InferletError(f"--tool-choice: unknown tool {c!r} (tools: {', '.join(TOOLS)}, or auto)")
    if not choices or max_turns < 0:
        raise InferletError("--tool-choice needs at least one entry and --max-turns must be >= 0")
    return choices


def think(agent: Agent, max_tokens: int) -> str:
    """One "Thought:" line, then the "Action:" prompt; returns the thought as generated."""
    agent.add("Thought:")
    thought = agent.generate("\n", max_tokens)
    if not thought.endswith("\n"):
        agent.add("\n")
    agent.add("Action:")
    return thought


def pick_tool(agent: Agent, turn: int, choices: list[str], max_turns: int) -> str:
    """The turn's tool: forced "finish" on the last turn, else --tool-choice's entry or the model's pick."""
    choice = choices[min(turn, len(choices) - 1)]
    if turn == max_turns:
        return "finish"
    if choice == "auto":
        return agent.choose(TOOLS)
    return choice


def tool_argument(agent: Agent, tool: str, max_tokens: int) -> str:
    """Write `tool[`, let the model write the argument, and close the bracket."""
    agent.add(f" {tool}[")
    raw = agent.generate("]", max_tokens)
    arg = raw.split("]")[0].split("\n")[0].strip()
    if "]" not in raw:
        agent.add("]")
    return arg


def call_tool(tool: str, arg: str, docs: list[str], turn: int, timeout_ms: int) -> str:
    """The tool's observation, on one line."""
    if tool == "calculator":
        obs = calculator(arg)
    elif tool == "lookup":
        obs = lookup(arg, docs)
    else:
        obs = ask_user(arg, turn, timeout_ms)
    return " ".join(obs.split())


def run_agent(agent: Agent, opts, choices: list[str], docs: list[str]) -> tuple[str, list[dict[str, str]]]:
    """Thought / Action / Observation turns until "finish"; (final answer, turns)."""
    turns: list[dict[str, str]] = []
    for turn in range(opts.max_turns + 1):
        thought = think(agent, opts.thought_tokens)
        tool = pick_tool(agent, turn, choices, opts.max_turns)
        if tool == "finish":
            agent.add(" finish\nFinal Answer:")
            answer = agent.generate("\n", opts.answer_tokens).strip()
            turns.append({"thought": thought.strip(), "tool": "finish", "arg": "", "observation": ""})
            return answer, turns
        arg = tool_argument(agent, tool, opts.arg_tokens)
        obs = call_tool(tool, arg, docs, turn, opts.client_timeout_ms)
        agent.add(f"\nObservation: {obs}\n")
        turns.append({"thought": thought.strip(), "tool": tool, "arg": arg, "observation": obs})
        send(json.dumps({"type": "step", "turn": turn, "tool": tool, "arg": arg, "observation": obs}))
    return "", turns


def main(args: list[str]) -> str | None:
    opts = PARSER.parse(args)
    choices = tool_choices(opts.tool_choice, opts.max_turns)
    docs = opts.doc if opts.doc else DEFAULT_DOCS
    model = get_model()
    prompt = model.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Question: " + opts.question}], True)
    agent = Agent(opts.stateless, prompt)
    try:
        answer, turns = run_agent(agent, opts, choices, docs)
    finally:
        agent.close()
    if opts.json:
        return json.dumps({"answer": answer, "transcript": agent.text, "turns": turns,
                           "prefill_tokens": agent.prefill_tokens})
    return answer
