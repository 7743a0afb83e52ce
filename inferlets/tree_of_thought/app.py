"""tree_of_thought: branch, score, prune; answer from the best-scored branch.

From the question's context, every kept node forks --branch children, each sampling one reasoning
step (all children decode at once). Each new step is scored by the model itself: a fork of the
branch is asked "Is this reasoning correct? Answer Yes or No." and the score is
P(Yes) / (P(Yes) + P(No)) from one `next_dist` pass. A branch's score is the mean of its steps'
scores. The --keep best branches survive to the next level (ties: earlier branch first), the
others are released. After --depth levels the best-scored branch writes the final answer.

Returns the answer; with --json {"answer", "levels": [[{"id", "parent", "step", "score", "kept"}]],
"chosen": id}.
"""

from __future__ import annotations

import json

from inferlet import ArgumentParser, Context, InferletError, Sampler, get_model, send, wait_any
from inferlet.sampler import AnyOf, MaxTokens, UntilText, UntilTokens


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="tree_of_thought", description="Tree of thought: branch, score, prune.")  # fmt: skip
    p.add_argument(
        "-q", "--question", default="Tom has 3 apples and buys 4 more. How many apples does he have?"
    )
    p.add_argument("--depth", type=int, default=2, help="reasoning steps (2)")
    p.add_argument("--branch", type=int, default=3, help="children per kept node (3)")
    p.add_argument("--keep", type=int, default=2, help="branches kept per level (2)")
    p.add_argument("--step-tokens", type=int, default=24, help="most tokens per step (24)")
    p.add_argument("--answer-tokens", type=int, default=24, help="most tokens in the answer (24)")
    p.add_argument("-t", "--temperature", type=float, default=0.9, help="sampling temperature of steps (0.9)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    p.add_argument("--json", action="store_true", help="return the whole tree as JSON")
    return p


PARSER = parser()
JUDGE = "\nQuestion to myself: is this reasoning correct? Answer Yes or No.\nAnswer:"


class Node:
    def __init__(self, nid: int, parent: int | None, ctx: Context, scores: list[float]) -> None:
        self.id, self.parent, self.ctx, self.scores = nid, parent, ctx, scores
        self.step = ""

    @property
    def score(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else 0.0


def decode_all(ctxs: list[Context], samplers: list[Sampler], stop, model) -> list[str]:
    """Decode every context at once (one pass per live context per step) until `stop`."""
    out: list[list[int]] = [[] for _ in ctxs]
    live = {i: c.submit_decode(samplers[i]) for i, c in enumerate(ctxs)}
    while live:
        done = wait_any(list(live.values()))
        i = next(k for k, f in live.items() if f is done)
        out[i].append(done.result)
        if stop.check(out[i], model.decode) is not None:
            del live[i]
        else:
            live[i] = ctxs[i].submit_decode(samplers[i].with_seed(samplers[i].seed + len(out[i])))
    stops = set(model.stop_tokens)
    return [model.decode([t for t in ids if t not in stops]) for ids in out]


def judge_all(ctxs: list[Context], model) -> list[float]:
    """P(Yes) / (P(Yes) + P(No)) for each branch, asked in a throwaway fork, all passes at once."""
    yes, no = model.encode(" Yes")[0], model.encode(" No")[0]
    forks = [c.fork() for c in ctxs]
    try:
        for f in forks:
            f.fill(JUDGE)
        passes = [f.submit_dist(32) for f in forks]
        pending = list(passes)
        while pending:
            pending.remove(wait_any(pending))
        scores = []
        for p in passes:
            dist = dict(zip(*p.result, strict=False))
            y, n = dist.get(yes, 0.0), dist.get(no, 0.0)
            scores.append(y / (y + n) if y + n > 0 else 0.0)
        return scores
    finally:
        for f in forks:
            f.release()


def question_context(model, question: str) -> Context:
    """The root of the tree: the system instruction and the question, prefilled."""
    root = Context(model)
    root.fill_chat(
        [
            {"role": "system", "content": "Think step by step. Write one short step per line."},
            {"role": "user", "content": question},
        ]
    )
    root.flush()
    return root


def branch(frontier: list[Node], n: int, depth: int, next_id: int) -> tuple[list[Node], int]:
    """`n` children of every kept node, each prompted for the next step; (children, next free id)."""
    children: list[Node] = []
    for node in frontier:
        for b in range(n):
            # the last child continues in the parent's own context
            ctx = node.ctx if b == n - 1 else node.ctx.fork()
            ctx.fill(f"Step {depth + 1}:")
            children.append(Node(next_id, node.id, ctx, list(node.scores)))
            next_id += 1
    return children, next_id


def write_and_score(children: list[Node], opts, step_stop, model) -> None:
    """Sample every child's step (all at once), end it with a newline, and score it by the judge."""
    samplers = [
        Sampler(opts.temperature, 0, 0.95, 0.0, opts.seed * 7919 + c.id * 104729) for c in children
    ]
    steps = decode_all([c.ctx for c in children], samplers, step_stop, model)
    for c, s in zip(children, steps, strict=False):
        c.step = s.strip()
        if not s.endswith("\n"):
            c.ctx.fill("\n")
    for c, s in zip(children, judge_all([c.ctx for c in children], model), strict=False):
        c.scores.append(s)


def prune(children: list[Node], keep: int, levels: list[list[dict]]) -> list[Node]:
    """The `keep` best children (ties: earlier first); records the level, releases the others."""
    ranked = sorted(range(len(children)), key=lambda i: (-children[i].score, i))
    kept = set(ranked[:keep])
    levels.append(
        [
            {"id": c.id, "parent": c.parent, "step": c.step, "score": c.score, "kept": i in kept}
            for i, c in enumerate(children)
        ]
    )
    for i, c in enumerate(children):
        if i not in kept:
            c.ctx.release()
    return [children[i] for i in ranked[:keep]]


def grow_tree(root: Context, opts, model, stop_tokens) -> tuple[Node, str, list[list[dict]]]:
    """Branch, score and prune for --depth levels; (best node, its final answer, the levels)."""
    step_stop = AnyOf(MaxTokens(opts.step_tokens), UntilText("\n"), stop_tokens)
    frontier = [Node(0, None, root, [])]
    levels: list[list[dict]] = []
    next_id = 1
    try:
        for depth in range(opts.depth):
            children, next_id = branch(frontier, opts.branch, depth, next_id)
            write_and_score(children, opts, step_stop, model)
            frontier = prune(children, opts.keep, levels)
            send(f"level {depth + 1}: kept " + ", ".join(f"#{n.id} ({n.score:.3f})" for n in frontier))
        best = frontier[0]
        best.ctx.fill("Final answer:")
        answer = best.ctx.generate(
            Sampler.greedy(), stop=AnyOf(MaxTokens(opts.answer_tokens), stop_tokens)
        ).strip()
    finally:
        for n in frontier:
            n.ctx.release()
    return best, answer, levels


def main(args: list[str]) -> str | None:
    opts = PARSER.parse(args)
    if min(opts.depth, opts.branch, opts.keep, opts.step_tokens, opts.answer_tokens) < 1:
        raise InferletError("--depth, --branch, --keep, --step-tokens, --answer-tokens must be >= 1")
    model = get_model()
    stop_tokens = UntilTokens(model.stop_tokens)
    best, answer, levels = grow_tree(question_context(model, opts.question), opts, model, stop_tokens)
    if opts.json:
        return json.dumps({"answer": answer, "levels": levels, "chosen": best.id, "chosen_score": best.score})
    return answer
