"""agent_swarm: instances with roles, chained by publish/subscribe; the last one answers the client.

Launch one instance per role with the same --swarm id and --role 0, 1, ... (any launch order).
Role i > 0 subscribes to `swarm/<id>/<i>`, marks itself ready in the host's key-value store and
waits for the chain; it adds its contribution (generated from the task and the previous
contribution) and publishes the chain to role i + 1 once that one is ready. The last role sends the
finished chain to its client. With --role all (the default) one instance plays every role in turn,
still passing the chain through publish/subscribe. With --spawn the instance plays role 0 and
launches one child inferlet per other role (WIT 0.5.0 `runtime.launch`): the children are ended
with it, and the last one's chain comes back to it (a child's client is its parent), so one
launch runs a swarm of instances.

Returns the last contribution; with --json the chain {"task", "contributions": [{"role", "index",
"instance", "text"}]}.
"""

from __future__ import annotations

import json
import time

from inferlet import (
    ArgumentParser,
    Child,
    Context,
    InferletError,
    Sampler,
    get_model,
    instance_id,
    launch,
    publish,
    receive_published,
    send,
    store_delete,  # fmt: skip
    store_exists,
    store_set,
    subscribe,
)
from inferlet.sampler import AnyOf, MaxTokens, UntilTokens

ROLE_PROMPTS = {
    "planner": "You are the planner. List the two or three key points the answer must cover.",
    "writer": "You are the writer. Write a short answer to the task, using the plan.",
    "critic": "You are the critic. Name one concrete way to improve the answer above.",
    "editor": "You are the editor. Write the final short answer, applying the critique.",
}


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="agent_swarm", description="Role-playing instances chained by publish/subscribe.")  # fmt: skip
    p.add_argument("--task", default="Explain why the sky is blue in two sentences.")
    p.add_argument("--roles", default="planner,writer,critic,editor", help="comma-separated roles, in order")
    p.add_argument("--role", default="all", help="this instance's role index, or 'all' (default)")
    p.add_argument(
        "--swarm", default=None, help="swarm id shared by its instances (default: this instance's id)"
    )
    p.add_argument("-n", "--max-tokens", type=int, default=40, help="most tokens per contribution (40)")
    p.add_argument("--timeout-ms", type=int, default=300000, help="wait for the previous role (300000)")
    p.add_argument("--json", action="store_true", help="return the whole chain as JSON")
    p.add_argument("--spawn", action="store_true",
                   help="play role 0 and launch one child inferlet per other role (needs a host serving WIT 0.5.0)")
    return p


PARSER = parser()


def contribute(role: str, chain: dict, max_tokens: int) -> str:
    model = get_model()
    system = ROLE_PROMPTS.get(role, f"You are the {role}. Contribute to the task in a few sentences.")
    prompt = f"{system}\n\nTask: {chain['task']}"
    if chain["contributions"]:
        last = chain["contributions"][-1]
        prompt += f"\n\nThe {last['role']} wrote:\n{last['text']}"
    with Context(model) as ctx:
        ctx.fill_chat([{"role": "user", "content": prompt}])
        ctx.flush()
        stop = AnyOf(MaxTokens(max_tokens), UntilTokens(model.stop_tokens))
        return ctx.generate(Sampler.greedy(), stop=stop).strip()


def wait_ready(key: str, timeout_ms: int) -> None:
    deadline = time.monotonic() + timeout_ms / 1000
    while not store_exists(key):
        if time.monotonic() > deadline:
            raise InferletError(f"the next role did not get ready within {timeout_ms} ms ({key})")
        time.sleep(0.01)
    store_delete(key)


def receive_chain(topic: str, timeout_ms: int) -> dict:
    got = receive_published(timeout_ms)
    if got is None:
        raise InferletError(f"no chain arrived on {topic} within {timeout_ms} ms")
    return json.loads(got[1])


def main(args: list[str]) -> str | None:
    p = PARSER
    opts = p.parse(args)
    roles = [r.strip() for r in opts.roles.split(",") if r.strip()]
    if not roles or opts.max_tokens < 1:
        raise InferletError("--roles needs at least one role and --max-tokens must be >= 1")
    swarm = opts.swarm or instance_id()
    me = instance_id()
    if opts.spawn:
        return spawn(opts, roles, swarm)
    if opts.role == "all":
        mine = list(range(len(roles)))
        for i in mine[1:]:
            subscribe(f"swarm/{swarm}/{i}")
    else:
        try:
            i = int(opts.role)
        except ValueError:
            raise InferletError(f"--role must be an index or 'all', got {opts.role!r}") from None
        if not 0 <= i < len(roles):
            raise InferletError(f"--role {i} outside 0..{len(roles) - 1}")
        mine = [i]
        if i > 0:
            subscribe(f"swarm/{swarm}/{i}")
            store_set(f"swarm/{swarm}/ready/{i}", me)
    chain: dict = {"task": opts.task, "contributions": []}
    text = ""
    for i in mine:
        if i > 0:
            chain = receive_chain(f"swarm/{swarm}/{i}", opts.timeout_ms)
        text = contribute(roles[i], chain, opts.max_tokens)
        chain["contributions"].append({"role": roles[i], "index": i, "instance": me, "text": text})
        if i == len(roles) - 1:
            send(json.dumps(chain))
            break
        if opts.role != "all":
            wait_ready(f"swarm/{swarm}/ready/{i + 1}", opts.timeout_ms)
        publish(f"swarm/{swarm}/{i + 1}", json.dumps(chain))
    return json.dumps(chain) if opts.json else text


def spawn(opts, roles: list[str], swarm: str) -> str:  # type: ignore[no-untyped-def]
    """Role 0 here, every other role in a child of this instance; the last child's chain comes back."""
    common = ["--swarm", swarm, "--roles", ",".join(roles), "--task", opts.task, "-n", str(opts.max_tokens),
              "--timeout-ms", str(opts.timeout_ms)]
    kids: list[Child] = [launch("", [*common, "--role", str(i)]) for i in range(1, len(roles))]
    chain: dict = {"task": opts.task, "contributions": []}
    text = contribute(roles[0], chain, opts.max_tokens)
    chain["contributions"].append({"role": roles[0], "index": 0, "instance": instance_id(), "text": text})
    if kids:
        wait_ready(f"swarm/{swarm}/ready/1", opts.timeout_ms)
        publish(f"swarm/{swarm}/1", json.dumps(chain))
        final = kids[-1].receive(opts.timeout_ms)
        if final is None:
            raise InferletError(f"the last role sent no chain within {opts.timeout_ms} ms")
        chain = json.loads(final)
        for kid in kids:
            kid.wait(opts.timeout_ms)
    send(json.dumps(chain))
    return json.dumps(chain) if opts.json else chain["contributions"][-1]["text"]
