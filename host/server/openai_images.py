"""Images in chat requests (issue 53): `image_url` content parts resolved to bytes and checked before
anything is launched.

`openai_request` parses a user message's `image_url` parts (and the Responses API's `input_image`)
into `{"type": "image_url", "url": ...}` parts; `resolve_images` then, for a request that has any:
refuses them for a model without a vision tower, bounds their count (`ImageLimits.max_images`),
decodes each `data:` URL's base64, fetches each http(s) URL (only with `ImageLimits.allow_remote`:
through `host.net.client.HttpService`, every hop checked by `HttpPolicy`, so `*` never reaches a
loopback, private or link-local address; bounded in bytes and time), bounds each image's bytes
(`max_bytes`) and decodes it with the backend's own decoder (`gpu_backend.models.image_preprocess
.decode_image`, off the event loop), so an image the vision tower would refuse is a 400 naming it,
never a failed stream. The parts become `{"type": "image", "media_type": ..., "data": base64}`, what
the handler gets (docs/openai.md, "Images").
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import re
from typing import Any

from host.server.openai_errors import OpenAIError
from host.server.openai_request import OpenAIRequest

__all__ = ["EMBED_IMAGE_MAX_BYTES", "ImageFetcher", "ImageLimits", "count_images", "resolve_images"]

MIB = 2**20
# The most bytes the host's `embed.embed-image` takes (host/api/embed.py MAX_IMAGE_BYTES; the image
# crosses in base64, a string, so wasmtime's per-call bound on a list<u8> does not apply). Whatever
# --max-image-mb says, a larger image is a 400 here, not a failed handler.
EMBED_IMAGE_MAX_BYTES = 20 * MIB
_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(?:;[^,;]*)*),(?P<data>.*)", re.S | re.I)


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """Bounds on a chat request's images (pie-serve --max-image-mb, --max-images, --allow-remote-images)."""

    max_bytes: int = 20 * MIB  # one image's encoded bytes (at most EMBED_IMAGE_MAX_BYTES take effect)
    max_images: int = 8  # images in one request
    # HttpPolicy patterns the server may fetch image URLs from ("*": any host on a global address);
    # empty: http(s) image URLs are refused
    allow_remote: tuple[str, ...] = ()
    fetch_timeout_s: float = 10.0  # one fetch, redirects included


def _bad(where: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"messages: {where}: {message}", param="messages")


def count_images(messages: tuple[dict[str, Any], ...] | list[dict[str, Any]] | None) -> int:
    """Image parts in chat messages (either form: `image_url` before `resolve_images`, `image` after)."""
    return sum(1 for m in messages or () if isinstance(m.get("content"), list)
               for p in m["content"] if p.get("type") in ("image", "image_url"))


class ImageFetcher:
    """Remote image URLs fetched for the OpenAI routes: `HttpService` with the allowed patterns, the
    image bound as its response bound, the fetch timeout as its time bound."""

    def __init__(self, limits: ImageLimits, resolver: Any = None) -> None:
        from host.net.client import HttpLimits, HttpService

        self.service = HttpService(limits.allow_remote, limits=HttpLimits(
            max_response_bytes=limits.max_bytes, timeout_s=limits.fetch_timeout_s, per_tenant=64), resolver=resolver)

    async def fetch(self, url: str, tenant: str, where: str) -> tuple[bytes, str]:
        """(the bytes, the response's media type or "") of an image URL; OpenAIError 400 if it cannot be had."""
        from host.net.client import FetchError

        try:
            reply = await asyncio.wrap_future(self.service.submit(tenant, "GET", url, [("Accept", "image/*")], b"",
                                                                  None))
        except FetchError as e:
            why = str(e).partition(": ")[2].replace("--http-allow", "--allow-remote-images")
            if e.kind == "too-large":
                why = "the image is over the server's bound of its bytes (--max-image-mb)"
            raise _bad(where, f"cannot fetch {url[:200]}: {e.kind}: {why}") from None
        if reply.status != 200:
            raise _bad(where, f"fetching {url[:200]} answered HTTP {reply.status}")
        ctype = next((v for k, v in reply.headers if k.lower() == "content-type"), "")
        media = ctype.split(";")[0].strip().lower()
        return reply.body, media if media.startswith("image/") else ""

    def close(self) -> None:
        self.service.close()


def _data_url(url: str, limits: ImageLimits, where: str) -> tuple[bytes, str]:
    m = _DATA_URL.fullmatch(url)
    if m is None:
        raise _bad(where, "a data URL is data:<media type>;base64,<data>")
    if "base64" not in [p.strip().lower() for p in m["params"].split(";")]:
        raise _bad(where, "a data URL's image must be base64 (data:image/png;base64,...)")
    data = re.sub(r"\s+", "", m["data"])
    if len(data) // 4 * 3 > limits.max_bytes + 2:  # before decoding it
        raise _bad(where, f"the image is about {len(data) // 4 * 3} bytes, over the server's bound of "
                   f"{limits.max_bytes} (--max-image-mb)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _bad(where, f"the data URL's base64 does not decode ({e})") from None
    return raw, m["type"].strip().lower()


def _checked(items: list[tuple[str, bytes | None, str, str]], limits: ImageLimits) -> list[tuple[str, str]]:
    """(media type, base64) of each image: `items` are (url, fetched bytes or None for a data URL, the
    fetched media type, where). Raises OpenAIError 400 for the first that is too large or does not
    decode with the backend's decoder. Runs off the event loop (base64 and decoding take a while)."""
    from gpu_backend.models.image_preprocess import ImageError, decode_image

    out = []
    for url, fetched, fetched_media, where in items:
        data, media = (fetched, fetched_media) if fetched is not None else _data_url(url, limits, where)
        if not data:
            raise _bad(where, "the image is empty")
        if len(data) > limits.max_bytes:
            raise _bad(where, f"the image is {len(data)} bytes, over the server's bound of {limits.max_bytes} "
                       "(--max-image-mb)")
        if len(data) > EMBED_IMAGE_MAX_BYTES:
            raise _bad(where, f"the image is {len(data)} bytes, over the {EMBED_IMAGE_MAX_BYTES} the host takes; "
                       "send a smaller encoding (JPEG, or fewer pixels)")
        try:
            decode_image(data, media or None).close()
        except ImageError as e:
            raise _bad(where, str(e)) from None
        out.append((media, base64.b64encode(data).decode()))
    return out


async def resolve_images(req: OpenAIRequest, limits: ImageLimits, image_tokens: int | None,
                         fetcher: ImageFetcher | None, tenant: str = "local") -> OpenAIRequest:
    """`req` with its `image_url` parts as `image` parts (media type, base64 bytes), each checked;
    OpenAIError 400 naming the image and the problem. `image_tokens`: the model's (0: it has no
    vision tower; None: not known, e.g. a test's fake host, then not checked)."""
    n = count_images(req.messages)
    if not n:
        return req
    if image_tokens == 0:
        raise OpenAIError(400, f"messages: the model {req.model!r} takes no images (it has no vision tower); "
                          "send text only", param="messages")
    if n > limits.max_images:
        raise OpenAIError(400, f"messages: {n} images, more than the {limits.max_images} one request may carry "
                          "(--max-images)", param="messages")
    places: list[tuple[int, int]] = []  # (message, part) of each image
    items: list[tuple[str, bytes | None, str, str]] = []
    for i, m in enumerate(req.messages or ()):
        if not isinstance(m.get("content"), list):
            continue
        for j, p in enumerate(m["content"]):
            if p.get("type") != "image_url":
                continue
            where, url = f"message {i}, image {len(items)}", p["url"]
            scheme = url.split(":", 1)[0].lower() if ":" in url else ""
            fetched, media = None, ""
            if scheme in ("http", "https"):
                if fetcher is None:
                    raise _bad(where, f"this server does not fetch image URLs ({url[:200]}); send the image inline as "
                               "a data URL (data:image/png;base64,...), or start the server with "
                               "--allow-remote-images")
                fetched, media = await fetcher.fetch(url, tenant, where)
            elif scheme != "data":
                raise _bad(where, f"an image URL must be a data: URL (or http(s) where the server allows it), got "
                           f"{url[:60]!r}")
            places.append((i, j))
            items.append((url, fetched, media, where))
    encoded = await asyncio.to_thread(_checked, items, limits)
    messages = [dict(m) for m in req.messages or ()]
    for (i, j), (media, data) in zip(places, encoded, strict=True):
        parts = messages[i]["content"] = list(messages[i]["content"])
        parts[j] = {"type": "image", "media_type": media, "data": data}
    return dataclasses.replace(req, messages=tuple(messages))
