"""Fakes of the WIT interfaces `runtime`, `messaging`, `store` and `model`, in memory."""

from __future__ import annotations

import json

from inferlet import _host
from inferlet.testing.records import WitMessage, trap
from inferlet.testing.tiny import TinyBackend

__all__ = ["FakeMessaging", "FakeModel", "FakeRuntime", "FakeStore"]


class FakeRuntime:
    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.returned: str | None = None
        self.logs: list[str] = []
        self.priority_value = 0  # as launched; `set_priority` changes it
        self.priorities: list[int] = []  # every value set, in order

    def version(self) -> str:
        return "0.1.0-fake"

    def instance_id(self) -> str:
        return "fake-instance"

    def arguments(self) -> list[str]:
        return list(self.args)

    def set_return(self, value: str) -> None:
        self.returned = value

    def log(self, message: str) -> None:
        self.logs.append(message)

    def elapsed_ms(self) -> int:
        return 0

    def set_priority(self, priority: int) -> None:
        # The host traps a bad value (host/levels.py check_priority), in the same words.
        if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
            raise trap("runtime.set-priority", f"priority must be from -1000 to 1000 (lower runs sooner), "
                                               f"got {priority!r}")
        self.priority_value = priority
        self.priorities.append(priority)

    def priority(self) -> int:
        return self.priority_value


class FakeMessaging:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.inbox: list[str] = []
        self.topics: set[str] = set()
        self.published: list[tuple[str, str]] = []

    def send(self, message: str) -> None:
        self.sent.append(message)

    def receive(self, timeout_ms: int | None) -> str | None:
        return self.inbox.pop(0) if self.inbox else None

    def publish(self, topic: str, message: str) -> None:
        if topic in self.topics:
            self.published.append((topic, message))

    def subscribe(self, topic: str) -> None:
        self.topics.add(topic)

    def unsubscribe(self, topic: str) -> None:
        self.topics.discard(topic)

    def receive_published(self, timeout_ms: int | None) -> tuple[str, str] | None:
        return self.published.pop(0) if self.published else None


class FakeStore:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def exists(self, key: str) -> bool:
        return key in self.data

    def list_keys(self) -> list[str]:
        return list(self.data)


class FakeModel:
    """The `model` interface, answered from the backend's info and tokenizer."""

    Message = WitMessage

    def __init__(self, backend: TinyBackend) -> None:
        self.backend = backend

    def available_models(self) -> list[str]:
        return [self.backend.info.name]

    def load_model(self, name: str) -> None:
        if name != self.backend.info.name:
            raise _host.Err(f"unknown model {name!r}; available: {self.backend.info.name}")

    def model_name(self) -> str:
        return self.backend.info.name

    def vocab_size(self) -> int:
        return self.backend.info.vocab_size

    def stop_tokens(self) -> list[int]:
        return list(self.backend.info.stop_tokens)

    def chat_template(self) -> str:
        return self.backend.info.chat_template

    def apply_chat_template(self, messages: list[WitMessage], add_generation_prompt: bool) -> str:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        return self.backend.tokenizer.apply_chat_template(chat, add_generation_prompt)

    def apply_chat_template_json(self, messages: str, tools: str, add_generation_prompt: bool) -> str:
        try:
            kwargs = {"tools": json.loads(tools)} if tools else {}
            return self.backend.tokenizer.apply_chat_template(json.loads(messages), add_generation_prompt, **kwargs)
        except Exception as e:  # the real host's error case
            raise _host.Err(f"chat template failed: {e}") from None

    def encode(self, text: str) -> list[int]:
        return self.backend.tokenizer.encode(text)

    def encode_prompt(self, text: str) -> list[int]:
        return self.backend.tokenizer.encode_prompt(text)

    def decode(self, tokens: list[int]) -> str:
        return self.backend.tokenizer.decode(tokens)
