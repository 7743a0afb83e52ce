"""The host flags `pie-run` and `pie-serve` share, defined once, and the `HostConfig` they make.

Every flag defaults to None, meaning "not given": `host_config_from_args` passes on only the
flags that were given, so the rest keep `HostConfig`'s defaults (shown in the help).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from host.batching.policy import POLICIES
from host.children import ChildLimits
from host.config import DTYPES, ENGINES, HostConfig
from host.net.limits import HttpLimits
from host.state.prefix_cache import PREFIX_CACHE_MODES

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["add_host_options", "host_config_from_args", "split_inferlet_args", "DTYPES"]

MIB = 2**20


# What --model loads (checked against gpu_backend's own lists by tests/test_backend_families.py;
# written out here so that `--help` and the --server path import no torch).
MODEL_FAMILIES = ("Families: Llama 2/3 (SmolLM2), Mistral (sliding window), Qwen2/2.5, Qwen3, Gemma 2, Gemma 3 "
                  "(text), Phi-3, LLaVA (CLIP tower, images) from an HF dir (model_type llama, mistral, qwen2, "
                  "qwen3, gemma2, gemma3_text, gemma3, phi3, llava); GGUF architectures llama, qwen2, qwen3, gemma2, gemma3, phi3. Tokenizers: byte-level BPE and "
                  "SentencePiece (tokenizer.json; GGUF gpt2 and llama vocabularies). See docs/models.md.")


def _prefill_chunk(value: str) -> int | str:
    """`--prefill-chunk`: "auto" or an int."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {value!r}") from None


def _default(name: str) -> Any:
    """HostConfig's default for field `name`, shown in the help so it is stated in one place."""
    return next(f.default for f in dataclasses.fields(HostConfig) if f.name == name)


def add_host_options(parser: argparse.ArgumentParser) -> None:
    """Add the model, KV cache, batching and per-instance limit flags to `parser`."""
    parser.add_argument("--model", help=f"GGUF file or HF safetensors dir (default: SmolLM2-135M-Instruct). {MODEL_FAMILIES}")
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="weights/KV dtype (default: float32 on CPU, bfloat16 on CUDA; "
                             "bfloat16 is ~2x faster on CPUs with bf16)")
    parser.add_argument("--page-size", type=int, help=f"tokens per KV page (default {_default('page_size')})")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--num-pages", type=int,
                        help="KV pages to preallocate (default: from --gpu-memory-utilization on CUDA, a 256 MiB "
                             "budget on CPU)")
    budget.add_argument("--kv-memory", type=int, metavar="MB", help="KV cache size in MiB (instead of --num-pages)")
    parser.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                        help="on CUDA without --kv-memory / --num-pages: the KV cache takes this fraction of the "
                             "GPU's memory less what is in use, the weights and 1 GiB for activations, like "
                             f"vLLM's (default {_default('gpu_memory_utilization')})")
    parser.add_argument("--policy", choices=list(POLICIES), help=f"batching policy (default {_default('policy')})")
    parser.add_argument("--max-batch-tokens", type=int,
                        help=f"cap on tokens per batch (default {_default('max_batch_tokens')})")
    parser.add_argument("--prefill-chunk", type=_prefill_chunk, metavar="auto|N",
                        help="how long prompts share batches with running decodes, so those keep stepping "
                             "instead of waiting for a whole prefill. auto: a batch with running decodes takes "
                             "as many prefill tokens as keep its predicted time within --prefill-ratio "
                             "decode-only steps, from a running fit of the batches' measured times (fixed + per "
                             "token), so the chunk suits the backend (a few tokens on CPU, hundreds on a GPU); N: "
                             "a forward of more than N new tokens runs in chunks of N, one batch each; 0 = never "
                             f"split (default {_default('prefill_chunk')}; bench/qos.py measures both)")
    parser.add_argument("--prefill-ratio", type=float, metavar="R",
                        help="with --prefill-chunk auto: a batch with prefill chunks takes at most R times a "
                             f"decode-only step (default {_default('prefill_ratio')})")
    parser.add_argument("--memory-limit-mb", type=int,
                        help=f"memory limit per instance, all linear memories and tables together (default {_default('memory_limit_bytes') // MIB} MiB)")
    parser.add_argument("--wall-budget-s", type=float, help="wall-clock budget per instance in seconds (default: none)")
    parser.add_argument("--swap-memory", type=int, metavar="MB",
                        help="host memory for the KV pages of instances suspended under KV pressure, to be "
                             "resumed when pages free up; 0 = never suspend (an instance waiting for pages "
                             f"nobody frees then ends with out_of_resources) (default {_default('swap_memory_bytes') // MIB} MiB)")
    parser.add_argument("--max-pages-per-instance", type=int, help="KV pages one instance may hold (default: no cap)")
    parser.add_argument("--max-pages-per-tenant", type=int,
                        help="KV pages the instances of one tenant may hold together, so one tenant cannot take "
                             "the whole cache (default: no cap)")
    parser.add_argument("--max-kv-store-mb", type=float,
                        help="keys and values one tenant may keep in the inferlets' key-value store "
                             f"(default {_default('max_kv_store_bytes') // MIB} MiB)")
    parser.add_argument("--max-inbox-kb", type=int,
                        help="unread client messages per instance; a signal past it is refused "
                             f"(default {_default('max_inbox_bytes') // 1024} KiB)")
    parser.add_argument("--max-embedding-slots", type=int,
                        help="embedding slots (WIT embed) one instance may hold at once "
                             f"(default {_default('max_embedding_slots')})")
    parser.add_argument("--max-embedding-mb", type=float,
                        help="bytes of vectors one instance's embedding slots may hold at once "
                             f"(default {_default('max_embedding_bytes') // MIB} MiB)")
    parser.add_argument("--prefix-cache", choices=list(PREFIX_CACHE_MODES),
                        help="automatic prefix cache: entries kept per client (tenant), shared by all clients "
                             f"(a timing side channel between them), or off (default {_default('prefix_cache')})")
    parser.add_argument("--max-instances", type=int,
                        help=f"instances running at once; more launches wait in the launch queue (default {_default('max_instances')})")
    parser.add_argument("--launch-queue", type=int, metavar="N",
                        help="launches that may wait for a free instance slot, in order; one more is refused "
                             f"(HTTP 503); 0 = refuse at once (default {_default('launch_queue')})")
    parser.add_argument("--launch-queue-timeout-s", type=float,
                        help="a queued launch that waited this long ends with out_of_resources "
                             f"(default {_default('launch_queue_timeout_s'):g})")
    parser.add_argument("--warm-instances", type=int,
                        help="instances of each recently launched program started ahead of demand, so a launch "
                             f"skips the start-up (default {_default('warm_instances')})")
    parser.add_argument("--warm-auto", type=int, metavar="N",
                        help="also keep as many instances of each recent program warm as it has had running "
                             f"at once, up to N parked in all; 0 = off (default {_default('warm_auto')})")
    parser.add_argument("--switch-interval-ms", type=float, metavar="MS",
                        help="the GIL switch interval while the host runs: how long the scheduler may wait for the "
                             "GIL while instances start; 0 = Python's 5 ms (default: 0.5 on a CUDA device, where it "
                             "was measured to help, else Python's)")
    parser.add_argument("--workers", type=_workers, metavar="N",
                        help="run the inferlets' guests in N worker processes, each with its own interpreter (the "
                             "scheduler, KV pages and model stay in this process); 0 = in this process; auto = one "
                             "per core, at most 8, none on one core (default: $PIE_WORKERS, else auto; pie-run, which runs "
                             "one instance, takes 0 for auto unless --workers is given; docs/deployment.md, 'Workers')")
    parser.add_argument("--engine", choices=list(ENGINES),
                        help="where the model runs: inproc = in this process, on the scheduler thread; "
                             "process = in engine processes fed over pyzmq + msgpack; auto = inproc for one "
                             "engine of one rank, else process (default auto; docs/deployment.md)")
    parser.add_argument("--tp", type=int, metavar="N",
                        help="tensor parallel: N ranks per engine over torch.distributed (NCCL on GPUs, "
                             f"gloo on CPU) (default {_default('tp')})")
    parser.add_argument("--replicas", type=int, metavar="N",
                        help="data parallel: N engines, each with its own KV cache; an instance lives on one "
                             f"(default {_default('replicas')})")
    _add_outbound_options(parser)


def _add_outbound_options(parser: argparse.ArgumentParser) -> None:
    """Outbound HTTP and child inferlets (docs/deployment.md, "Security")."""
    lim, kids = HttpLimits(), ChildLimits()
    g = parser.add_argument_group("outbound HTTP and child inferlets", "what inferlets may reach and start")
    g.add_argument("--http-allow", action="append", default=None, metavar="HOST[:PORT]",
                   help="let every tenant's inferlets send HTTP requests to HOST (repeatable): a name, *.domain, *, "
                        "an address or a CIDR ([v6] in brackets), PORT a number or * (absent: any). Names reach "
                        "public addresses only; a loopback, private, link-local or metadata address only when "
                        "listed by address (or localhost). Default: no outbound HTTP at all")
    g.add_argument("--tenant-http-allow", action="append", default=None, metavar="TENANT=HOST[:PORT]",
                   type=_tenant_pattern, help="one more pattern for one tenant's inferlets only (repeatable)")
    g.add_argument("--http-max-request-kb", type=int, metavar="KB",
                   help=f"largest request body (default {lim.max_request_bytes // 1024})")
    g.add_argument("--http-max-response-kb", type=int, metavar="KB",
                   help=f"largest response body; a longer one is an error (default {lim.max_response_bytes // 1024})")
    g.add_argument("--http-timeout-s", type=float, metavar="S",
                   help=f"longest request, redirects included (default {lim.timeout_s:g})")
    g.add_argument("--http-max-per-tenant", type=int, metavar="N",
                   help=f"requests in flight for one tenant's instances together (default {lim.per_tenant})")
    g.add_argument("--max-child-depth", type=int, metavar="N",
                   help=f"how deep child inferlets (runtime.launch) nest (default {kids.max_depth})")
    g.add_argument("--max-children", type=int, metavar="N",
                   help=f"children one instance runs at once (default {kids.per_parent})")
    g.add_argument("--max-children-per-tenant", type=int, metavar="N",
                   help=f"children one tenant's instances run at once (default {kids.per_tenant})")
    g.add_argument("--allow-detached-children", action="store_true", default=None,
                   help="let an inferlet launch a child that outlives it (default: children end with their parent)")


def _tenant_pattern(text: str) -> tuple[str, str]:
    name, sep, pattern = text.partition("=")
    if not sep or not name or not pattern:
        raise argparse.ArgumentTypeError(f"--tenant-http-allow takes TENANT=HOST[:PORT], got {text!r}")
    return name, pattern


def _outbound_config(args: argparse.Namespace) -> dict[str, Any]:
    """HostConfig's http_* and child_limits from the flags given (HttpLimits / ChildLimits check them)."""
    out: dict[str, Any] = {}
    if getattr(args, "http_allow", None):
        out["http_allow"] = tuple(args.http_allow)
    if getattr(args, "tenant_http_allow", None):
        out["http_tenant_allow"] = tuple(args.tenant_http_allow)
    for key, cls, given in (
            ("http_limits", HttpLimits, {"max_request_bytes": _kib(args.http_max_request_kb),
                                         "max_response_bytes": _kib(args.http_max_response_kb),
                                         "timeout_s": args.http_timeout_s, "per_tenant": args.http_max_per_tenant}),
            ("child_limits", ChildLimits, {"max_depth": args.max_child_depth, "per_parent": args.max_children,
                                           "per_tenant": args.max_children_per_tenant,
                                           "allow_detached": args.allow_detached_children})):
        fields = {k: v for k, v in given.items() if v is not None}
        if fields:  # (only limits given: the rest keep their class's defaults)
            out[key] = cls(**fields)
    return out


def host_config_from_args(args: argparse.Namespace) -> HostConfig:
    """A `HostConfig` from the flags that were given (and `data_dir` where the command has one).

    Raises:
        ValueError: naming the bad value, from `HostConfig`'s validation.
    """
    given: dict[str, Any] = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "page_size": args.page_size,
        "num_pages": args.num_pages, "kv_memory_bytes": _mib(args.kv_memory), "policy": args.policy,
        "max_batch_tokens": args.max_batch_tokens, "prefill_chunk": args.prefill_chunk,
        "prefill_ratio": args.prefill_ratio,
        "memory_limit_bytes": _mib(args.memory_limit_mb),
        "wall_budget_s": args.wall_budget_s, "max_pages_per_instance": args.max_pages_per_instance,
        "max_pages_per_tenant": args.max_pages_per_tenant, "swap_memory_bytes": _mib(args.swap_memory),
        "max_inbox_bytes": _kib(args.max_inbox_kb), "max_embedding_slots": args.max_embedding_slots,
        "max_embedding_bytes": None if args.max_embedding_mb is None else int(args.max_embedding_mb * MIB),
        "max_kv_store_bytes": None if args.max_kv_store_mb is None else int(args.max_kv_store_mb * MIB),
        "prefix_cache": args.prefix_cache, "max_instances": args.max_instances,
        "gpu_memory_utilization": args.gpu_memory_utilization, "launch_queue": args.launch_queue, "launch_queue_timeout_s": args.launch_queue_timeout_s,
        "warm_instances": args.warm_instances, "warm_auto": args.warm_auto,
        "switch_interval_ms": args.switch_interval_ms,
        "engine": args.engine, "tp": args.tp, "replicas": args.replicas, "workers": args.workers,
        "data_dir": getattr(args, "data_dir", None),
    }
    given.update(_outbound_config(args))
    return HostConfig(**{k: v for k, v in given.items() if v is not None})


def _workers(text: str) -> int | str:
    """--workers: "auto" or an int in [0, 256]."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers takes a number of worker processes or auto, got {text!r}") from None
    if not 0 <= n <= 256:
        raise argparse.ArgumentTypeError(f"--workers must be in [0, 256], got {n}")
    return n


def _kib(value: int | None) -> int | None:
    return None if value is None else value * 1024


def _mib(value: int | None) -> int | None:
    return None if value is None else value * MIB


def split_inferlet_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the command's own arguments, the inferlet's): the inferlet's follow a `--`."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []
