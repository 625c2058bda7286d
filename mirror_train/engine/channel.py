"""The token channel and the draft worker: how the engine reaches its draft server.

Three placements, one interface (`send(msg)`, `recv(timeout_s)`, `close()`):
- `ProcessDraft`: the server in its own process (spawned), pinned to its own core with one thread, over a pipe:
  the two-device layout on a CPU (shared/docs/mirror-sd.md: ~31 µs a message). A CUDA draft device works the same
  way: the worker loads the draft on it.
- `GlooDraft`: the same worker, the messages over torch.distributed (gloo) point-to-point: the layout across
  machines. Tested with two local processes on loopback.
- `LocalDraft`: the server called in-process, nothing concurrent: for tests and for measuring a draft alone.

A worker that dies, raises or stops answering within the timeout raises `DraftUnavailable` on the engine side,
which then finishes the generation target-only. Workers ignore SIGINT (Ctrl-C reaches the engine, which shuts them
down), exit when the engine's end of the channel closes, and are daemonic, so none outlives the engine.
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from datetime import timedelta
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import mirror_train.models  # noqa: F401  (registers the draft's Auto classes for the worker's from_pretrained)
from mirror_train import fastpath
from mirror_train.datastore import Datastore
from mirror_train.engine.drafts import ModelDraft, SyntheticDraft, SyntheticDraftConfig
from mirror_train.engine.messages import Failed, Ready, Stop, expects_reply
from mirror_train.engine.server import DraftServer
from mirror_train.errors import MirrorTrainError


class DraftUnavailable(Exception):
    """The draft worker is gone, failed or did not answer in time."""


# --- building the draft side (runs in the worker) ---------------------------------------------------------------
def build_server(spec: dict):
    """A DraftServer from a picklable spec: {"kind": "model", "path", "device", "use_streams"} or
    {"kind": "synthetic", "config": SyntheticDraftConfig fields, "vocab_size"}, plus "branch_budget",
    "adaptive_budget", "kappa", "dtype" (of the draft and the head here), "head" (the path of a proxy-head
    bundle when the head runs on this side) and "head_weights" (what its C call reads: EngineConfig.head_weights)."""
    dtype = getattr(torch, spec.get("dtype", "float32"))
    if spec["kind"] == "ngram":  # prompt lookup alone: no model
        backend = None
    elif spec["kind"] == "synthetic":
        backend = SyntheticDraft(SyntheticDraftConfig(**spec["config"]), spec["vocab_size"])
    else:
        model = AutoModelForCausalLM.from_pretrained(spec["path"], dtype=dtype).to(spec.get("device", "cpu")).eval()
        fastpath.install(model.requires_grad_(False), spec.get("fast_path", "none"))
        backend = ModelDraft(model, use_streams=spec.get("use_streams", True))
    head = None
    if spec.get("head"):  # the proxy head runs here: rebuild it from its bundle (engine.py, `_head_bundle`)
        bundle = torch.load(spec["head"], weights_only=False, map_location=spec.get("device", "cpu"))
        head = bundle["end"].to(dtype).head(bundle["cfg"], bundle["state"], bundle["vocab_ids"]).to(dtype)
        # like the draft, it only proposes: the fastest path per call (bf16, 5 rows here: 4.1 → 1.7 ms, docs/engine.md)
        fastpath.install_head(head, spec.get("fast_path", "none"), spec.get("head_weights", "served"))
    store = Datastore.load(spec["datastore"]) if spec.get("datastore") else None
    return DraftServer(
        backend,
        spec.get("branch_budget", 1),
        spec.get("adaptive_budget", False),
        head,
        spec.get("kappa", 4),
        spec.get("ngram_tokens", 0),
        spec.get("adaptive_window", False),
        spec.get("device", "cpu"),
        store,
        spec.get("lookup_roots", False),
    )


def _pin(core: int | None, threads: int) -> None:
    if core is not None and hasattr(os, "sched_setaffinity"):  # macOS cannot pin: the OS places the worker
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(threads)


def serve(transport, spec: dict, core: int | None, threads: int) -> None:
    """The worker's loop: build the server, say ready (or why not), answer messages until stop or a closed channel."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _pin(core, threads)
    try:
        server = build_server(spec)
    except Exception as e:  # noqa: BLE001  (reported to the engine, which raises it as a clear error)
        transport.send(Failed(f"{type(e).__name__}: {e}"))
        return
    transport.send(Ready(os.getpid()))
    # A failure while the engine expects no answer (a no-reply verdict, Branches, the work after a reply) is told
    # with the next message that expects one: sent unasked, it would wait for a receive that never comes (over gloo
    # the engine's next send then blocked for two minutes), and the messages in between are dropped.
    failed = None
    while True:
        try:
            msg = transport.recv(None)
        except (EOFError, OSError, RuntimeError, DraftUnavailable):
            return  # the engine is gone
        if isinstance(msg, Stop):
            return
        if failed is None:
            try:
                reply, after = server.handle(msg)
            except Exception:  # noqa: BLE001  (reported to the engine, which warns and goes on target-only)
                failed, reply, after = traceback.format_exc(limit=4), None, None
        if failed is not None:
            if expects_reply(msg):
                transport.send(Failed(failed))
                return
            continue
        if reply is not None:
            transport.send(reply)
        if after is not None:
            try:
                after()
            except Exception:  # noqa: BLE001
                failed = traceback.format_exc(limit=4)


# --- transports -------------------------------------------------------------------------------------------------
class PipeTransport:
    def __init__(self, conn):
        self.conn = conn

    def send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, OSError) as e:
            raise DraftUnavailable(f"the draft's channel is closed ({type(e).__name__})") from None

    def recv(self, timeout_s: float | None) -> Any:
        try:
            if timeout_s is not None and not self.conn.poll(timeout_s):
                raise DraftUnavailable(f"the draft did not answer within {timeout_s:g} s")
            return self.conn.recv()
        except (EOFError, OSError) as e:
            raise DraftUnavailable(f"the draft's channel is closed ({type(e).__name__})") from None

    def close(self) -> None:
        self.conn.close()


class GlooTransport:
    """Pickled messages as uint8 tensors over torch.distributed point-to-point (a length, then the bytes)."""

    def __init__(self, peer: int):
        self.peer = peer

    def send(self, msg: Any) -> None:
        import torch.distributed as dist

        data = torch.frombuffer(bytearray(pickle.dumps(msg)), dtype=torch.uint8)
        try:
            dist.send(torch.tensor([data.numel()], dtype=torch.long), self.peer)
            dist.send(data, self.peer)
        except RuntimeError as e:
            raise DraftUnavailable(f"the draft's gloo channel failed: {str(e).splitlines()[0]}") from None

    def recv(self, timeout_s: float | None) -> Any:
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.long)
        try:
            work = dist.irecv(size, self.peer)
            if timeout_s is None:
                work.wait()
            elif not work.wait(timeout=timedelta(seconds=timeout_s)):
                raise DraftUnavailable(f"the draft did not answer within {timeout_s:g} s")
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(data, self.peer)
        except RuntimeError as e:
            if timeout_s is not None and "Timed out" in str(e):  # gloo raises its own timeout instead of False
                raise DraftUnavailable(f"the draft did not answer within {timeout_s:g} s") from None
            raise DraftUnavailable(f"the draft's gloo channel failed: {str(e).splitlines()[0]}") from None
        return pickle.loads(data.numpy().tobytes())

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _pipe_worker(conn, spec, core, threads):
    serve(PipeTransport(conn), spec, core, threads)


def _gloo_worker(address, port, spec, core, threads):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=1, world_size=2)
    transport = GlooTransport(peer=0)
    try:
        serve(transport, spec, core, threads)
    finally:
        transport.close()


# --- the engine's side ------------------------------------------------------------------------------------------
class LocalDraft:
    """The draft server in this process: calls instead of messages, no overlap."""

    def __init__(self, spec: dict):
        self.server = build_server(spec)
        self._reply = None

    def send(self, msg) -> None:
        # As in a worker: the server's tensors must not become inference tensors when a message is sent from
        # inside the target's inference mode (the prompt's states go out in the middle of its prefill).
        with torch.inference_mode(False):
            reply, after = self.server.handle(msg)
        if after is not None:
            after()
        self._reply = reply

    def recv(self, timeout_s: float | None = None) -> Any:
        reply, self._reply = self._reply, None
        if reply is None:
            raise DraftUnavailable("no reply pending")
        return reply

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


class ProcessDraft:
    """The draft server in a spawned worker process, over a pipe (or over gloo with `gloo_port`)."""

    def __init__(
        self,
        spec: dict,
        core: int | None = None,
        threads: int = 1,
        start_timeout_s: float = 120.0,
        gloo_port: int | None = None,
    ):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.gloo = gloo_port is not None
        if self.gloo:
            self.process = ctx.Process(
                target=_gloo_worker, args=("127.0.0.1", gloo_port, spec, core, threads), daemon=True
            )
            self.process.start()
            import torch.distributed as dist

            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{gloo_port}",
                rank=0,
                world_size=2,
                timeout=timedelta(seconds=start_timeout_s),
            )
            self.transport = GlooTransport(peer=1)
        else:
            ours, theirs = ctx.Pipe()
            self.process = ctx.Process(target=_pipe_worker, args=(theirs, spec, core, threads), daemon=True)
            self.process.start()
            theirs.close()
            self.transport = PipeTransport(ours)
        try:
            reply = self.recv(start_timeout_s)
        except DraftUnavailable as e:
            self.close()
            raise MirrorTrainError(f"the draft worker did not start: {e}") from None
        self.pid = reply.pid

    def send(self, msg) -> None:
        self.transport.send(msg)

    def recv(self, timeout_s: float | None) -> Any:
        if not self.process.is_alive() and not self.gloo and not self.transport.conn.poll():
            raise DraftUnavailable(f"the draft worker exited (code {self.process.exitcode})")
        reply = self.transport.recv(timeout_s)
        if isinstance(reply, Failed):
            self.close()
            raise DraftUnavailable(f"the draft worker failed: {reply.error.strip()}")
        return reply

    def alive(self) -> bool:
        return self.process.is_alive()

    def close(self) -> None:
        """Ask the worker to stop; terminate, then kill, what does not. Safe to call twice."""
        if self.process.is_alive():
            try:
                self.transport.send(Stop())
            except DraftUnavailable:
                pass
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.transport.close()
