"""The standalone process group of the collective weight path (gloo on CPU, NCCL on GPU).

Trainer rank 0 (rank 0) and the rollout replicas form a group of their own, separate
from Ray Train's (`ray.util.collective` cannot run inside a Train worker,
docs/stack_facts.md). It rendezvouses through a `TCPStore` served by trainer rank 0;
each membership (the driver's *epoch*) gets its own prefix, so a group is re-formed
whenever replicas join or leave. Weights go in flat buckets of `bucket_mb`: the sender
fills bucket k+1 (gathering FSDP shards parameter by parameter) while bucket k is on
the wire, and receivers copy out of a bucket while the next one arrives. Every call
has a timeout, so a dead member turns into an error, never a hang. The manifest
(names, shapes, dtypes) travels with the publication, so receivers need no model of
their own to unpack buckets.

Failure on NCCL (docs/gpu.md). A collective that never completes must end in an
error the trainer catches (then the object-store fallback), never in a hang or a
torn-down trainer. torch's NCCL watchdog would otherwise kill the process: Ray Train
sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down) for its own group, and a
`Work.wait()` without a timeout does not even block the CPU. So: (1) every push
starts with a readiness handshake through the store, with a timeout, so a receiver
that is dead or never joined is found before anyone enters NCCL; (2) our group is
built with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up, don't kill; the variable is
read by each group's constructor); (3) every wait has the group's timeout and a
failure aborts the group (`ProcessGroupNCCL.abort`) and raises; (4) `NCCL_ENV` goes
to the trainer workers and the replicas alike, before either creates a communicator;
(5) the communicator is nonblocking and created right after the handshake.

Why (5): a blocking `ncclCommInitRank` waits for every member with no timeout, so a
member dying between the handshake and the end of the set-up would leave everyone else
blocked for good, and the watchdog only times out enqueued work. torch 2.13 makes a
group's communicator nonblocking when its options say `config.blocking = 0` (this
takes precedence over TORCH_NCCL_USE_COMM_NONBLOCKING and touches no other group).
Then creating it returns at once, and every later wait for it (the first broadcast,
an abort) polls NCCL and raises a DistBackendError after TORCH_NCCL_NONBLOCKING_TIMEOUT
seconds. torch reads that variable once per process, at the first NCCL call that
could wait (a trainer's first FSDP collective already counts), so it travels in
`NCCL_ENV`, and it bounds communicator set-up, not `weights.timeout_s`. The group
connects eagerly (`eager_connect_single_device`) as soon as the handshake has found
every member ready, so the set-up overlaps the sender's first gather. Only a GPU run
can confirm this path: the CPU tests drive it through a stand-in for
`ProcessGroupNCCL` (torch's CPU build has none).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from areal_ray.weights.tensor_spec import TensorSpec, plan_buckets

# The environment of every process at either end of an NCCL weight push, set before its
# first NCCL communicator (NCCL reads these once per process). sglang sets
# NCCL_CUMEM_ENABLE=0 in its replica process when unset; both ends of a group must
# agree, so the trainer gets it too. TORCH_NCCL_DUMP_ON_TIMEOUT=0: a timed-out weight
# push would otherwise set a process-wide flag on which the monitor of Ray Train's own
# NCCL group kills the trainer minutes later.
# TORCH_NCCL_NONBLOCKING_TIMEOUT: the most seconds a nonblocking communicator of ours
# may take to be created (or aborted) before torch raises (see the module docstring).
COMM_TIMEOUT_S = 60
NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(COMM_TIMEOUT_S)}


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _env:
    """Environment variables set only inside the block."""

    def __init__(self, **values: str):
        self.values, self.saved = values, {}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def nccl_options(timeout: datetime.timedelta):
    """Options of our NCCL groups: `timeout` for every collective, and a nonblocking
    communicator, whose creation raises after TORCH_NCCL_NONBLOCKING_TIMEOUT instead of
    waiting for a dead member forever."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.config.blocking = 0
    return opts


class WeightGroup:
    """One epoch's process group. Rank 0 (trainer rank 0) also serves the store."""

    # Groups that were aborted: dropping one joins its watchdog thread, which can block.
    _aborted: list = []

    def __init__(self, store: dist.Store, epoch: int, rank: int, world: int,
                 timeout_s: float, backend: str = "gloo"):
        self.epoch, self.rank, self.world, self.backend = epoch, rank, world, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.transfers = 0  # pushes through this group, counted alike on every member
        self.store = dist.PrefixStore(f"weights-epoch-{epoch}", store)
        self.connected = backend != "nccl"  # gloo connects in its constructor
        if backend == "nccl":
            # A process started without NCCL_ENV (a script, a test) still gets the bound,
            # unless an NCCL call of its own has read the variable already.
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(COMM_TIMEOUT_S))
            with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):  # read by this constructor
                self.pg = dist.ProcessGroupNCCL(self.store, rank, world, nccl_options(self.timeout))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world, self.timeout)
            self.device = torch.device("cpu")

    @staticmethod
    def connect(host: str, port: int, timeout_s: float, is_master: bool = False) -> dist.TCPStore:
        return dist.TCPStore(host, port, None, is_master, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    @staticmethod
    def serve(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
        """(the rendezvous store, its port) served on `host` only: the socket is bound
        here and handed to the store, which would otherwise listen on every address of
        the node. The store owns the socket from then on and closes it when it is
        destroyed; a Python socket object closing the same descriptor too would close
        whatever reused its number in between (it once was Serve's router loop)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore(host, port, None, True,
                              datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=sock.fileno())
        sock.detach()
        return store, port

    def _ready_key(self, rank: int) -> str:
        return f"ready-{self.transfers}-{rank}"

    def _handshake(self) -> None:
        """Receivers announce they are about to receive; the sender waits for all of
        them (with the timeout) before it issues any collective."""
        if self.rank != 0:
            self.store.set(self._ready_key(self.rank), "1")
            return
        try:
            self.store.wait([self._ready_key(r) for r in range(1, self.world)], self.timeout)
        except Exception as e:  # noqa: BLE001 - DistStoreError on timeout
            missing = [r for r in range(1, self.world) if not self.store.check([self._ready_key(r)])]
            raise RuntimeError(f"weight group epoch {self.epoch}: ranks {missing} not ready "
                               f"within {self.timeout.total_seconds():.0f} s ({e})") from e

    def _connect(self) -> None:
        """Create the NCCL communicator now that the handshake found every member ready,
        not inside the first broadcast. Nonblocking, this returns at once; the first
        collective waits for the set-up, bounded (see the module docstring)."""
        if not self.connected:
            self.pg.eager_connect_single_device(self.device)
            self.connected = True

    def _broadcast(self, buf: torch.Tensor):
        return self.pg.broadcast(buf, 0)

    def _wait(self, work) -> None:
        # With a timeout: NCCL's wait() without one returns at once (it only orders
        # streams), and a timed-out wait raises here instead of in the watchdog.
        work.wait(self.timeout)

    def abort(self) -> None:
        """After a failure: abort NCCL's communicator so nothing of it lingers."""
        if self.backend == "nccl":
            WeightGroup._aborted.append(self.pg)
            try:
                self.pg.abort()
            except Exception:  # noqa: BLE001 - the abort itself timed out; the group is dropped anyway
                pass

    def _failed(self, e: Exception, what: str) -> RuntimeError:
        """Abort the group; the error as the RuntimeError the pusher falls back on
        (torch's DistBackendError and DistStoreError already are)."""
        self.abort()
        return e if isinstance(e, RuntimeError) else RuntimeError(
            f"weight group epoch {self.epoch} {what} failed: {e}")

    def send(self, tensors: Iterator[torch.Tensor], specs: Sequence[TensorSpec],
             bucket_bytes: int) -> dict:
        """Rank 0: consume `tensors` (in manifest order; e.g. gathered one by one) into
        buckets and broadcast them, filling the next while the previous is in flight.
        Any failure (a receiver not ready, dead or timed out) raises RuntimeError."""
        t0, nbytes = time.perf_counter(), 0
        try:
            self._handshake()
            self._connect()
            pending = None
            it = iter(tensors)
            for bucket in plan_buckets(specs, bucket_bytes):
                dtype = _dtype(specs[bucket[0]].dtype)
                if len(bucket) == 1:  # a tensor as large as a bucket goes as is: no copy
                    buf = next(it).to(device=self.device, dtype=dtype).contiguous().reshape(-1)
                else:
                    buf = torch.empty(sum(specs[i].numel for i in bucket), dtype=dtype,
                                      device=self.device)
                    off = 0
                    for i in bucket:
                        n = specs[i].numel
                        buf[off:off + n].copy_(next(it).reshape(-1))
                        off += n
                if pending is not None:
                    self._wait(pending)
                pending = self._broadcast(buf)
                nbytes += buf.numel() * buf.element_size()
            if pending is not None:
                self._wait(pending)
        except Exception as e:  # noqa: BLE001 - one error type for the caller's fallback
            raise self._failed(e, "send") from e
        finally:
            self.transfers += 1
        return {"send_s": time.perf_counter() - t0, "bytes": nbytes}

    def recv(self, specs: Sequence[TensorSpec], bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """Receivers: (name, tensor) views into each received bucket, in manifest order;
        the next bucket is already being received while the caller copies these out."""
        buckets = plan_buckets(specs, bucket_bytes)

        def post(bucket):
            buf = torch.empty(sum(specs[i].numel for i in bucket),
                              dtype=_dtype(specs[bucket[0]].dtype), device=self.device)
            return buf, self._broadcast(buf)

        try:
            self._handshake()
            self._connect()
            nxt = post(buckets[0]) if buckets else None
            for k, bucket in enumerate(buckets):
                buf, work = nxt
                self._wait(work)
                nxt = post(buckets[k + 1]) if k + 1 < len(buckets) else None
                off = 0
                for i in bucket:
                    n = specs[i].numel
                    yield specs[i].name, buf[off:off + n].view(specs[i].shape)
                    off += n
        except GeneratorExit:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._failed(e, "receive") from e
        finally:
            self.transfers += 1
