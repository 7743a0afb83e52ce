"""The Python SDK for Pie inferlets: programs that own the generation loop of an LLM request.

An inferlet is a module with `def main(args: list[str]) -> str | None`, built with `pie-build`.

    from inferlet import Context, Sampler, get_model

    def main(args):
        with Context() as ctx:
            ctx.fill_user("What is the capital of France?")
            return ctx.generate(Sampler.greedy(), max_tokens=64)

Do not call the host at import time: `pie-build` imports the module while building.
"""

from inferlet import embed, http
from inferlet.args import ArgumentParser
from inferlet.children import Child, ChildError, ChildFailed, launch, parent
from inferlet.context import ChatError, Context, Forward, wait_any
from inferlet.entry import HelpRequested, InferletError, make_world
from inferlet.grammar import Grammar, GrammarError, Matcher, any_json, choice, ebnf, json_schema, lark, regex
from inferlet.model import Model, ModelError, TemplateError, available_models, get_model
from inferlet.pages import PAGES, OutOfPages
from inferlet.runtime import (
    args,
    elapsed_ms,
    instance_id,
    log,
    priority,
    publish,
    receive,
    receive_published,
    send,
    set_priority,
    set_return,
    store_delete,
    store_exists,
    store_get,
    store_keys,
    store_set,
    subscribe,
    unsubscribe,
    version,
)
from inferlet.sampler import AnyOf, MaxTokens, Sampler, Stop, UntilSequence, UntilText, UntilTokens

__all__ = [
    "ArgumentParser", "Context", "Forward", "wait_any", "ChatError", "InferletError", "HelpRequested", "make_world",
    "Model", "ModelError", "TemplateError", "get_model", "available_models", "PAGES", "OutOfPages",
    "Grammar", "GrammarError", "Matcher", "json_schema", "regex", "choice", "ebnf", "lark", "any_json",
    "Sampler", "Stop", "MaxTokens", "UntilTokens", "UntilSequence", "UntilText", "AnyOf",
    "args", "version", "instance_id", "set_return", "log", "elapsed_ms", "set_priority", "priority",
    "send", "receive", "publish", "subscribe", "unsubscribe", "receive_published",
    "store_get", "store_set", "store_delete", "store_exists", "store_keys",
    "embed", "http", "launch", "parent", "Child", "ChildError", "ChildFailed",
]  # fmt: skip
