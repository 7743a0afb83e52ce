"""The engine process: loads the backend and serves the host's requests over the socket
(`python -m gpu_backend.engine.server`; the host starts it through `ProcessBackend`,
gpu_backend/engine/client.py). With `--tp N` it is rank 0 of a tensor-parallel group and starts
ranks 1..N-1 itself (gpu_backend/engine/tp.py), or joins the group `torchrun` set up. It exits when
its parent (the host) dies.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import Any

from gpu_backend.engine.spec import POLL_MS, EngineSpec, describe_exit
from gpu_backend.types import ForwardError

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the process that started us dies (no orphaned engines)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _device_for(spec: EngineSpec, local_rank: int) -> str | None:
    import torch

    dev = spec.device
    if dev is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        need, have = spec.tp * spec.replicas, torch.cuda.device_count()
        if need > have:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise RuntimeError(f"--tp {spec.tp} x --replicas {spec.replicas} needs {need} GPUs, but {have} "
                               f"{'is' if have == 1 else 'are'} visible"
                               f"{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''}: "
                               "lower --tp or --replicas, or make more GPUs visible")
        dev = f"cuda:{spec.replica * spec.tp + local_rank}"
    return dev


def _load(spec: EngineSpec, tp: Any, device: str | None) -> Any:
    import torch

    if spec.standin:
        from gpu_backend.standin import StandInBackend

        sb = StandInBackend(page_size=spec.page_size, num_pages=spec.num_pages or 64, delay_s=spec.standin_delay_s)
        return sb
    from gpu_backend.build import load_backend

    dtype = None if spec.dtype is None else getattr(torch, spec.dtype)
    return load_backend(spec.model, device=device, dtype=dtype, page_size=spec.page_size, num_pages=spec.num_pages,
                        kv_memory_bytes=spec.kv_memory_bytes, progress=False, attention=spec.attention, tp=tp,
                        gpu_memory_utilization=spec.gpu_memory_utilization)


def _set_threads(spec: EngineSpec) -> None:
    import torch

    n = spec.threads or max(1, (os.cpu_count() or 1) // max(1, spec.tp * spec.replicas))
    torch.set_num_threads(n)


def _hello_payload(spec: EngineSpec, backend: Any) -> dict[str, Any]:
    # swap: host memory per page when pages can be swapped out and back (gpu_backend.types.SwapsPages),
    # kept in this process; 0 with tensor parallel (each rank would have to keep its share)
    swap = backend.swap_page_bytes if spec.tp == 1 else 0
    if spec.standin:
        return {"kind": "standin", "info": asdict(backend.info), "swap_page_bytes": swap}
    tok = backend.tokenizer
    return {"kind": "model", "info": asdict(backend.info), "tokenizer": asdict(tok.spec), "swap_page_bytes": swap}


def _embed_image(backend: Any, data: bytes, media_type: str) -> bytes:
    """An image's vectors: the stand-in's own `embed_image`, or the model's vision tower (rank 0 runs
    it alone: the tower is not sharded, and its vectors reach the other ranks inside the pass that
    takes them). ValueError for an image that does not decode or a model without a tower."""
    own = getattr(backend, "embed_image", None)
    if own is not None:
        return bytes(own(bytes(data), media_type))
    import numpy as np

    from gpu_backend.images import embed_image

    return np.ascontiguousarray(embed_image(backend, bytes(data), media_type), dtype="<f4").tobytes()


def _serve(spec: EngineSpec, endpoint: str, backend: Any, tp: Any) -> None:
    """Rank 0: answer the host's requests until `stop` or until the host goes away."""
    import zmq

    from gpu_backend.engine.wire import decode_requests, encode_results, pack, unpack

    ctx: Any = zmq.Context.instance()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    gc.collect()  # the model, torch and the wire live as long as this process: keep them out of
    gc.freeze()  # every later full collection (~100 ms each with all of torch tracked; host/host.py)
    sock.send(pack(["ready", _hello_payload(spec, backend)]))
    parent = os.getppid()
    idle_since = time.monotonic()
    tp_on = tp is not None and tp.world > 1
    swapped: dict[int, Any] = {}  # swap_out's copies in this process, by handle (the host keeps the handle)
    while True:
        if not sock.poll(POLL_MS):
            if os.getppid() != parent:
                log.warning("engine: the host went away; exiting")
                return
            if tp_on and time.monotonic() - idle_since > 60.0:
                backend.ping()  # keeps the other ranks' waits from timing out
                idle_since = time.monotonic()
            continue
        op, payload = unpack(sock.recv())
        fatal = False
        try:
            if op == "forward":
                reply: list[Any] = ["ok", encode_results(backend.forward(decode_requests(payload)))]
            elif op == "copy":
                backend.copy_tokens(*payload)
                reply = ["ok", None]
            elif op == "swap_out":  # [handle, pages, handles the host dropped]
                for h in payload[2]:
                    swapped.pop(h, None)
                swapped[payload[0]] = backend.swap_out(payload[1])
                reply = ["ok", None]
            elif op == "swap_in":  # [handle, pages]
                copy = swapped.pop(payload[0], None)
                if copy is None:
                    raise ValueError(f"swap_in: no swapped pages under handle {payload[0]} (the engine restarted?)")
                backend.swap_in(copy, payload[1])
                reply = ["ok", None]
            elif op == "input_embeddings":
                reply = ["ok", backend.input_embeddings(payload)]
            elif op == "embed_image":  # [bytes, media type]
                reply = ["ok", _embed_image(backend, payload[0], payload[1])]
            elif op == "logits":
                out = backend.logits(decode_requests(payload))
                reply = ["ok", [[list(t.shape), t.float().cpu().numpy().tobytes()] for t in out]]
            elif op == "stop":
                sock.send(pack(["ok", None]))
                return
            else:
                reply = ["error", ["ValueError", f"unknown engine op {op!r}"]]
        except ForwardError as e:
            reply = ["forward_error", [e.request_index, str(e)]]
        except ValueError as e:  # a request rejected before anything ran
            reply = ["error", ["ValueError", str(e)]]
        except Exception as e:
            log.exception("engine: %s failed", op)
            reply = ["error", [type(e).__name__, str(e)]]
            fatal = tp_on  # a failure inside a collective leaves the group out of step: start over
        sock.send(pack(reply))
        idle_since = time.monotonic()
        if fatal:
            log.error("engine: tensor-parallel group out of step after an error; exiting so the host restarts it")
            os._exit(70)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_backend.engine.server",
                                 description="A pie engine process (started by the host, or by torchrun)")
    ap.add_argument("--spec", required=True, help="EngineSpec as JSON")
    ap.add_argument("--endpoint", help="rank 0: the host's zmq endpoint")
    ap.add_argument("--tmpdir", help="private directory for the rendezvous file")
    ap.add_argument("--rank", type=int, default=0, help="this rank (started by rank 0)")
    ap.add_argument("--init", help="rendezvous (init_method) of the tensor-parallel group")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PIE_ENGINE_LOG", "WARNING"),
                        format=f"%(levelname)s engine[rank {args.rank}] %(name)s: %(message)s")
    if args.rank != 0:
        # PR_SET_PDEATHSIG fires when the *thread* that started us ends: fine for ranks started by
        # rank 0's main thread; rank 0 itself (started from any host thread) polls its parent pid
        _die_with_parent()
    spec = EngineSpec.from_json(args.spec)
    if not spec.standin:
        _set_threads(spec)
    tp = None
    workers: list[subprocess.Popen[bytes]] = []
    rank, local_rank, init = args.rank, args.rank, args.init
    from gpu_backend.engine.tp import env_rank, init_tp

    launched = env_rank()
    if launched is not None:  # torchrun: it started every rank and set up the rendezvous
        rank, world, local_rank = launched
        if world != spec.tp:
            print(f"engine: WORLD_SIZE={world} but the spec asks for tp={spec.tp}", file=sys.stderr)
            return 2
        init = "env://"
    try:
        device = _device_for(spec, local_rank) if not spec.standin else "cpu"
    except RuntimeError as e:
        print(f"engine: {e}", file=sys.stderr)
        if rank == 0 and args.endpoint:
            _send_failure(args.endpoint, str(e))
        return 1
    if spec.tp > 1:
        import torch

        if device is not None and device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        if rank == 0 and launched is None:
            assert args.tmpdir is not None
            init = f"file://{args.tmpdir}/tp-rendezvous"
            for r in range(1, spec.tp):
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "gpu_backend.engine.server", "--spec", args.spec, "--rank", str(r),
                     "--init", init], stdin=subprocess.DEVNULL))
        assert init is not None
        if workers:
            threading.Thread(target=_watch_workers, args=(workers,), daemon=True).start()
        tp = init_tp(rank, spec.tp, init, "cuda" if device and device.startswith("cuda") else "cpu")
    try:
        try:
            backend = _load(spec, tp, device)
        except Exception as e:
            log.exception("engine: loading failed")
            if rank == 0 and args.endpoint:
                _send_failure(args.endpoint, f"{type(e).__name__}: {e}")
            return 1
        if rank != 0:
            from gpu_backend.engine.tp import TPWorker

            assert tp is not None
            TPWorker(backend, tp).serve()
            return 0
        if not args.endpoint:
            print("engine: rank 0 needs --endpoint", file=sys.stderr)
            return 2
        _serve(spec, args.endpoint, backend, tp)
        if tp is not None:
            backend.stop_workers()
        return 0
    finally:
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
        if tp is not None:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _watch_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    """Rank 0: a rank that dies leaves every collective hanging: exit at once, so the host sees the
    engine die and starts the whole group again."""
    while True:
        for w in workers:
            rc = w.poll()
            if rc is not None and rc != 0:
                log.error("engine: rank process %d died (%s); exiting", w.pid, describe_exit(rc))
                os._exit(71)
        time.sleep(0.05)


def _send_failure(endpoint: str, message: str) -> None:
    import zmq

    from gpu_backend.engine.wire import pack

    sock: Any = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    sock.send(pack(["failed", message]))
    sock.close()


if __name__ == "__main__":
    sys.exit(main())
