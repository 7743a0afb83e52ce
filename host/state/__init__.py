"""Host state shared by instances: KV page ownership, the key-value store, pub/sub topics."""

from host.state.kvstore import KeyValueStore
from host.state.pages import InstancePages, PageError, PageManager
from host.state.topics import Subscriber, Topics

__all__ = ["InstancePages", "KeyValueStore", "PageError", "PageManager", "Subscriber", "Topics"]
