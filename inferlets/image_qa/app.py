"""image_qa: answer a question about an image, on a vision-language model (LLaVA-style).

    pie-run --model path/to/llava-1.5-7b-hf image_qa -- --image photo.jpg --question "What is in the picture?"

The image (`--image`: base64 bytes; pie-run reads a file for it, see inferlet.toml) goes through the
model's vision tower into the context where the chat template puts it (`Context.fill_chat` with an
image part), then the answer is generated greedily. Returns the answer; with --json {"answer",
"image_tokens"}. On a model without a vision tower it fails with the host's message.
"""

from __future__ import annotations

import base64
import binascii
import json

from inferlet import ArgumentParser, Context, InferletError, Sampler, embed, get_model, send
from inferlet.sampler import AnyOf, MaxTokens, UntilTokens


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="image_qa", description="Answer a question about an image.")
    p.add_argument("--image", required=True, help="the image, base64 (pie-run: a file name)")
    p.add_argument("--question", default="What is in the picture?")
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true", help="send the answer's text as it grows")
    p.add_argument("--json", action="store_true")
    return p


PARSER = parser()


def main(args: list[str]) -> str | None:
    opts = PARSER.parse(args)
    try:
        image = base64.b64decode(opts.image, validate=True)
    except (binascii.Error, ValueError):
        raise InferletError("--image must be base64 bytes (pie-run reads a file name for it)") from None
    model = get_model()
    if not embed.image_tokens():
        raise InferletError(f"model {model.name} has no vision tower: image_qa needs a vision-language model")
    with Context(model) as ctx:
        try:
            ctx.fill_chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                        {"type": "text", "text": "\n" + opts.question}]}])
        except embed.EmbedError as e:
            raise InferletError(f"the image: {e}") from None
        stop = AnyOf(MaxTokens(opts.max_tokens), UntilTokens(model.stop_tokens))
        answer = ctx.generate(Sampler.greedy(), stop=stop, on_text=send if opts.stream else None).strip()
    return json.dumps({"answer": answer, "image_tokens": embed.image_tokens()}) if opts.json else answer
