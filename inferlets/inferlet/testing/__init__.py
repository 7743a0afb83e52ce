"""A fake host for running inferlet code in plain CPython (unit tests, debugging).

    host = FakeHost(page_size=4, num_pages=32).install()
    ...  # use inferlet.Context etc.
    assert host.kv.held == set()

It checks calls the way the real host does and raises `FakeTrap` where the real host would trap
the instance. Behind it is `TinyBackend`, a tiny deterministic model implementing
`gpu_backend.types.Backend`: tokens are UTF-8 bytes (id = byte + 3; ids 0-2 are <s>, </s>,
<|im_end|>), and the next token is a function of the (token, position) pairs the row attends
to, so a wrong page, length or mask changes the output.

Only for CPython: the guest never imports this package (it needs `gpu_backend`).
"""

from inferlet.testing.host import FakeHost
from inferlet.testing.records import FakeTrap
from inferlet.testing.tiny import SPECIALS, VOCAB, ByteTokenizer, TinyBackend, TinyInfo, next_token

__all__ = [
    "FakeHost",
    "FakeTrap",
    "SPECIALS",
    "VOCAB",
    "ByteTokenizer",
    "TinyBackend",
    "TinyInfo",
    "next_token",
]
