"""Tensor parallelism's processes: one per rank. Rank 0 drives: its engine schedules and samples; `LeaderModel`
sends every forward (target and MTP) and every state-slot reset to the other ranks before running it on its own
shard, so all ranks call the same collectives in the same order. The other ranks (`_follower_main`) hold only their
shard and its caches and replay what they are sent. Commands travel over a pipe per follower (an idle leader is
fine; a dead one is EOF), tensors inside the model over the process group (gloo on the CPU, NCCL on CUDA).

Hand-offs (`tandem/cache/handoff.py`): rank 0 has the others gather their heads of a prompt's KV blocks and GDN
slot to it, or scatter them a received state's heads (`TPGroup.gather` / `scatter`, `Split.join` / `cut`), so a
hand-off carries the full model's state whatever the tensor-parallel size of either worker. The primitives
(`TPGroup`, `Split`) are `tandem/parallel.py`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
import weakref
from dataclasses import fields, is_dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.cache.handoff import gather_across_ranks, scatter_across_ranks
from tandem.cache.pools import CachePools
from tandem.model.source import load_model
from tandem.parallel import TPGroup, process_group, rank_device


def _to_device(obj, device: str):
    """Tensors inside obj (a dataclass such as ForwardBatch, a tuple or list, or a tensor) moved to device."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if is_dataclass(obj):
        return replace(obj, **{f.name: _to_device(getattr(obj, f.name), device) for f in fields(obj)})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(x, device) for x in obj)
    return obj


def _send(conn, msg) -> None:
    # Plain pickle of host tensors: our own spawned ranks on this host, never a network peer. (The connection's
    # default pickler would share tensor storage through file descriptors instead.)
    conn.send_bytes(pickle.dumps(_to_device(msg, "cpu")))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


class TensorParallelError(RuntimeError):
    fatal = True  # a lost rank cannot come back inside this process: a serving worker exits (EngineLoop)


def _cpu_threads(world_size: int) -> int:
    # Ranks on one host share its cores: more threads than cores makes each rank's idle OpenMP workers spin on
    # the cores the others need while they wait in an all-reduce (an order of magnitude slower on the CPU).
    return max(1, (os.cpu_count() or 1) // world_size)


class _Followers:
    """Rank 0's handle on the other ranks' processes: send commands, collect their errors, shut them down."""

    def __init__(self, procs, conns, on_close=None):
        self.procs, self.conns = procs, conns
        self._on_close = on_close
        self._closed = False

    def send(self, *cmd) -> None:
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            try:
                _send(conn, cmd)
            except (OSError, ValueError) as e:  # broken pipe, or closed by `close`
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone (exit code {proc.exitcode})") from e

    def expect(self, what: str, timeout: float) -> None:
        """Waits for `what` from every follower; raises on an error report, an early exit or the deadline."""
        deadline = time.monotonic() + timeout
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            while not conn.poll(0.05):
                if not proc.is_alive():
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited (code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank}: no {what!r} within {timeout:.0f} s")
            msg = _recv(conn)
            if msg[0] == "error":
                raise TensorParallelError(f"tensor-parallel rank {rank} failed:\n{msg[1]}")
            if msg[0] != what:
                raise TensorParallelError(f"tensor-parallel rank {rank}: expected {what!r}, got {msg[0]!r}")

    def errors(self) -> str:
        """What failed followers reported (they send their traceback before exiting), or that they are gone."""
        out = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            reported = []
            try:
                while conn.poll(0):
                    msg = _recv(conn)
                    if msg[0] == "error":
                        reported.append(f"rank {rank}:\n{msg[1]}")
            except (EOFError, OSError):
                pass
            if not reported and not proc.is_alive():
                reported.append(f"rank {rank} exited (code {proc.exitcode})")
            out += reported
        return "\n".join(out)

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                _send(conn, ("stop",))
            except (OSError, ValueError):
                pass  # already gone
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self.conns:
            conn.close()
        if self._on_close is not None:
            self._on_close()


class _LeaderMTP:
    def __init__(self, mtp, followers: _Followers):
        self._mtp, self._followers = mtp, followers

    def __getattr__(self, name):
        return getattr(self._mtp, name)

    def __call__(self, next_token_embeds, hidden, batch, inv_freq, kv_cache):
        self._followers.send("mtp", next_token_embeds, hidden, batch)
        return _guard(self._followers, lambda: self._mtp(next_token_embeds, hidden, batch, inv_freq, kv_cache))


def _guard(followers: _Followers, fn):
    try:
        return fn()
    except RuntimeError as e:  # a collective failed: say why, if a follower told us
        why = followers.errors()
        if why:
            raise TensorParallelError(f"a tensor-parallel rank failed:\n{why}") from e
        raise


class LeaderModel:
    """Rank 0's shard of a tensor-parallel model. Forwards are first sent to the other ranks (which run the same
    call on their shards and caches); everything else (lm_head, embedding, config, ...) is this shard's own, as
    those parts are replicated."""

    def __init__(self, model, followers: _Followers):
        self._model, self._followers = model, followers
        if hasattr(model, "mtp"):
            self.mtp = _LeaderMTP(model.mtp, followers)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, batch, caches):
        self._followers.send("forward", batch)
        return _guard(self._followers, lambda: self._model(batch, caches))

    def on_all_ranks(self, cmd: str, *args, here):
        """Work in which every rank meets in collectives (a hand-off's state gather or scatter): the other ranks
        are sent `cmd`, this one runs `here()`; returns what it returns."""
        self._followers.send(cmd, *args)
        return _guard(self._followers, here)

    def attach(self, pools) -> None:
        """The other ranks reset the same GDN state slots as rank 0's scheduler hands out."""
        local = pools.zero_slots

        def zero_everywhere(slots):
            local(slots)
            try:
                self._followers.send("zero_slots", slots)
            except TensorParallelError:
                pass  # the next forward reports it, outside the scheduler's admission bookkeeping

        pools.zero_slots = zero_everywhere

    def shutdown(self) -> None:
        self._followers.close()


def launch(model: str, ecfg, seed: int, world_size: int, timeout: float = 120.0):
    """Starts ranks 1..world_size-1 (spawned processes), joins them in a process group and loads rank 0's shard.
    Returns (cfg, LeaderModel, model_dir); `LeaderModel.shutdown()` (also run at garbage collection and exit)
    stops the other ranks."""
    ctx = mp.get_context("spawn")
    device = rank_device(ecfg.device, 0)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL's communicator and this rank's kernels on its own GPU
    # rank 0 hosts the rendezvous store on a free port
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timedelta(seconds=timeout), wait_for_workers=False)
    procs, conns = [], []
    for rank in range(1, world_size):
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_follower_main, name=f"tandem-tp{rank}", daemon=True,
                           args=(there, model, ecfg, seed, rank, world_size, store.port, timeout))
        proc.start()
        there.close()  # the child's end lives in the child: its exit is then EOF here
        procs.append(proc)
        conns.append(here)
    on_close = None
    if not device.startswith("cuda"):
        threads = torch.get_num_threads()
        torch.set_num_threads(_cpu_threads(world_size))
        on_close = lambda: torch.set_num_threads(threads)  # noqa: E731 -- this process's own setting back
    followers = _Followers(procs, conns, on_close)
    try:
        followers.expect("hello", timeout)  # started and imported: the group can form
        pg = process_group(dist.PrefixStore("tandem-tp", store), 0, world_size, device, timeout)
        tp = TPGroup(0, world_size, pg)
        cfg, net, model_dir = load_model(model, device, ecfg.dtype, seed, tp)
        followers.expect("ready", timeout)
    except BaseException:
        followers.close()
        raise
    leader = LeaderModel(net, followers)
    leader._store = store  # kept alive while the group is
    weakref.finalize(leader, followers.close)
    return cfg, leader, model_dir


def _follower_main(conn, model, ecfg, seed, rank, world_size, port, timeout):
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides when this rank stops (it finishes
    # or drains its requests first), so the interrupt is its alone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        device = rank_device(ecfg.device, rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(_cpu_threads(world_size))
        ecfg = replace(ecfg, device=device)
        _send(conn, ("hello",))
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timedelta(seconds=timeout))
        tp = TPGroup(rank, world_size, process_group(dist.PrefixStore("tandem-tp", store), rank, world_size,
                                                      device, timeout))
        cfg, net, _ = load_model(model, device, ecfg.dtype, seed, tp)
        pools = CachePools(cfg, ecfg, with_mtp=hasattr(net, "mtp"), tp=tp)
        _send(conn, ("ready",))
        with torch.inference_mode():
            while True:
                try:
                    cmd, *args = _recv(conn)
                except EOFError:
                    return  # rank 0 is gone
                args = _to_device(args, device)
                if cmd == "forward":
                    net(args[0], pools.layer_caches)
                elif cmd == "mtp":
                    embeds, hidden, batch = args
                    net.mtp(embeds, hidden, batch, net.inv_freq, pools.mtp_cache)
                elif cmd == "zero_slots":
                    pools.zero_slots(args[0])
                elif cmd == "gather_state":
                    gather_across_ranks(cfg, pools, *args)
                elif cmd == "scatter_state":
                    scatter_across_ranks(cfg, pools, *args, None)
                elif cmd == "stop":
                    # nothing to hand back: skip the interpreter's slow teardown of torch
                    conn.close()
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(0)
                else:
                    raise TensorParallelError(f"unknown command {cmd!r}")
    except BaseException:
        try:
            _send(conn, ("error", traceback.format_exc()))
        except Exception:
            pass
        raise
