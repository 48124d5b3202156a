"""Process groups, read from Megatron's parallel state in ONE place, and launch bootstrap.

Everything else in the package receives a ``ParallelGroups`` (or a single group
out of it) as an argument; no other module calls ``megatron.core.parallel_state``.
That keeps layouts explicit and lets tests build, tear down and rebuild many
layouts in one launch (``initialize_model_parallel`` ... ``destroy``).

Launch bootstrap (``init_distributed_from_env``) understands torchrun's
environment and ``mpirun`` (Open MPI / MPICH / Intel MPI through mpi4py: the
``cluster`` extra installs MPICH's wheel, whose ``mpirun`` lands next to the
interpreter); Ray workers set the torchrun variables themselves before calling it.
Under mpirun, MPI only hands out ranks and rank 0's address: the process group is
gloo / NCCL over TCP, as under torchrun.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from entr_megatron.utils.spawn import enter_rank, torchrun_env

__all__ = [
    "LaunchInfo",
    "ParallelGroups",
    "destroy",
    "init_distributed_from_env",
    "initialize_model_parallel",
    "launched_by_mpirun",
    "resolve_launch_env",
]


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of one Megatron layout, with this rank's coordinates.

    Group fields are ``torch.distributed`` process groups (size-1 groups are real
    groups too, so callers never special-case them). ``pg_collection`` is the same
    groups as Megatron's ``ProcessGroupCollection``, to pass to Megatron constructors.
    """

    tp: Any
    pp: Any
    dp: Any
    cp: Any
    ep: Any
    expert_tp: Any
    expert_dp: Any
    # Data-parallel group including context-parallel ranks: gradients are averaged over it.
    dp_cp: Any
    # First and last pipeline stage of each pipeline (tied embeddings); None on other stages.
    embedding: Any
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    ep_rank: int
    ep_size: int
    expert_tp_rank: int
    expert_tp_size: int
    # Virtual pipeline (interleaved) chunks per stage; None without interleaving.
    vpp_size: int | None
    pg_collection: Any

    @classmethod
    def from_megatron(cls) -> "ParallelGroups":
        """Snapshot Megatron's current parallel state (after ``initialize_model_parallel``)."""
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("Megatron model parallel is not initialized: call initialize_model_parallel first")
        return cls(
            tp=ps.get_tensor_model_parallel_group(),
            pp=ps.get_pipeline_model_parallel_group(),
            dp=ps.get_data_parallel_group(),
            cp=ps.get_context_parallel_group(),
            ep=ps.get_expert_model_parallel_group(),
            expert_tp=ps.get_expert_tensor_parallel_group(),
            expert_dp=ps.get_expert_data_parallel_group(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            embedding=ps.get_embedding_group(check_initialized=False),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
            expert_tp_size=ps.get_expert_tensor_parallel_world_size(),
            vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )

    def is_first_stage(self, vp_stage: int | None = None) -> bool:
        """Whether (virtual) stage ``vp_stage`` of this rank holds the embedding."""
        return self.pp_rank == 0 and (vp_stage is None or vp_stage == 0)

    def is_last_stage(self, vp_stage: int | None = None) -> bool:
        """Whether (virtual) stage ``vp_stage`` of this rank holds the output layer."""
        last_chunk = vp_stage is None or self.vpp_size is None or vp_stage == self.vpp_size - 1
        return self.pp_rank == self.pp_size - 1 and last_chunk


def _have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _cpu_compat_active() -> bool:
    # Set by entr_megatron.parallel.cpu_compat.enable_cpu_compat.
    from megatron.core.tensor_parallel import random as mp_random

    return getattr(mp_random.CudaRNGStatesTracker, "runs_on_cpu", False)


def initialize_model_parallel(
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    cp: int = 1,
    vpp: int | None = None,
    expert_tp: int = 1,
    seed: int = 1234,
) -> ParallelGroups:
    """Initialize Megatron's model parallel state and RNG on an initialized ``torch.distributed``.

    Args:
        tp, pp, ep, cp: tensor, pipeline, expert and context parallel sizes; the
            data-parallel size is ``world_size / (tp * pp * cp)``.
        vpp: virtual pipeline chunks per stage (interleaved schedule), or None.
        expert_tp: tensor-parallel size inside expert layers.
        seed: seeds the CPU generator and Megatron's model-parallel RNG tracker
            (same default stream on every rank, TP-rank-specific tracker streams).

    On CPU, call ``entr_megatron.parallel.cpu_compat.enable_cpu_compat()`` first (the
    learner does): Megatron's RNG tracker is CUDA-only without it.
    """
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp), ("expert_tp", expert_tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if vpp is not None and (not isinstance(vpp, int) or vpp < 1):
        raise ValueError(f"vpp must be None or a positive integer, got {vpp!r}")
    if vpp is not None and vpp > 1 and pp < 2:
        raise ValueError(f"vpp={vpp} (interleaved pipeline) needs pp >= 2, got pp={pp}")
    if cp > 1 and not _have_transformer_engine():
        raise ValueError(
            f"cp={cp}: context parallelism needs TransformerEngine's attention, which is not installed; "
            "use cp=1 (and a longer sequence per rank) or install transformer-engine on a GPU machine"
        )
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_distributed_from_env() first")
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    dp = world // (tp * pp * cp)
    if (dp * cp * tp) % (ep * expert_tp):
        raise ValueError(f"ep*expert_tp = {ep}*{expert_tp} must divide dp*cp*tp = {dp * cp * tp}")
    if not torch.cuda.is_available() and not _cpu_compat_active():
        raise RuntimeError(
            "megatron-core needs its CUDA call sites redirected on a CPU-only machine: "
            "call entr_megatron.parallel.cpu_compat.enable_cpu_compat() before initialize_model_parallel"
        )
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mp_random

    if ps.model_parallel_is_initialized():
        destroy()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=expert_tp,
    )
    torch.manual_seed(seed)
    mp_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return ParallelGroups.from_megatron()


def destroy() -> None:
    """Tear down Megatron's model parallel state so another layout can be initialized."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


# --- launch bootstrap -------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the launch: global rank, world size, local rank, how it was started."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun" or "mpirun"
    # Ranks on this node (LOCAL_WORLD_SIZE, or the MPI's local size); 1 when the launcher does not say.
    local_world_size: int = 1


_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
_MPI_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_MPI_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_mpirun(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a rank that mpirun started (``OMPI_COMM_WORLD_RANK`` or ``PMI_RANK``
    set) and not one that torchrun or our own spawning set up (``RANK`` set: those win)."""
    environ = os.environ if environ is None else environ
    return "RANK" not in environ and any(v in environ for v in _MPI_RANK_VARS)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _int_env(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {environ[name]!r}") from None


def resolve_launch_env(environ: Mapping[str, str] | None = None, mpi_comm=None) -> LaunchInfo:
    """Read rank, world size and rendezvous address from torchrun's or mpirun's environment.

    mpirun is recognised by ``OMPI_COMM_WORLD_RANK`` or ``PMI_RANK`` (when
    ``RANK`` is not also set); rank 0's address and a port (``MASTER_ADDR`` /
    ``MASTER_PORT`` if set, else its host name and a free port) are broadcast to
    all ranks over MPI. ``mpi_comm`` replaces ``mpi4py.MPI.COMM_WORLD`` (tests).
    """
    environ = os.environ if environ is None else environ
    if launched_by_mpirun(environ):
        if mpi_comm is None:
            try:
                from mpi4py import MPI  # lazy: only mpirun launches need it
            except ImportError as e:
                raise RuntimeError(
                    "launched by mpirun (OMPI_COMM_WORLD_RANK/PMI_RANK set) but mpi4py is not installed: "
                    "pip install mpi4py, or launch with torchrun"
                ) from e
            mpi_comm = MPI.COMM_WORLD
        rank, world = mpi_comm.Get_rank(), mpi_comm.Get_size()
        mine = None
        if rank == 0:
            addr = environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
            port = int(environ.get("MASTER_PORT") or _free_port())
            mine = (addr, port)
        addr, port = mpi_comm.bcast(mine, root=0)
        local = next((environ[v] for v in _MPI_LOCAL_RANK_VARS if v in environ), None)
        local_rank = int(local) if local is not None else int(environ.get("LOCAL_RANK", 0))
        local_size = next((int(environ[v]) for v in _MPI_LOCAL_SIZE_VARS if v in environ), 1)
        return LaunchInfo(rank, world, local_rank, addr, port, "mpirun", local_size)
    missing = [v for v in _TORCHRUN_VARS if v not in environ]
    if missing:
        raise ValueError(
            f"launch environment incomplete: {', '.join(missing)} not set; start the job with torchrun "
            "(or mpirun with mpi4py installed), or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
        )
    rank, world = _int_env(environ, "RANK"), _int_env(environ, "WORLD_SIZE")
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world}), got {rank}")
    local_rank = _int_env(environ, "LOCAL_RANK") if "LOCAL_RANK" in environ else 0
    local_size = _int_env(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else 1
    return LaunchInfo(rank, world, local_rank, environ["MASTER_ADDR"], _int_env(environ, "MASTER_PORT"), "torchrun",
                      local_size)


def init_distributed_from_env(timeout_minutes: float = 30.0, info: LaunchInfo | None = None) -> LaunchInfo:
    """Initialize ``torch.distributed`` from the launcher's environment (see ``resolve_launch_env``;
    ``info``: coordinates already resolved, e.g. by an mpirun rank that needed its rank earlier, since
    under mpirun resolving is a collective broadcast).

    Backend: NCCL when CUDA is available (the device is set to ``LOCAL_RANK``),
    gloo otherwise. Returns the launch coordinates; a no-op apart from reading
    them when ``torch.distributed`` is already initialized.

    Under mpirun the rank becomes a torchrun-style rank (``utils.spawn.enter_rank``): the torchrun
    variables are exported, rank 0 serves the rendezvous store on ``MASTER_ADDR`` only, and with
    ``MASTER_ADDR=127.0.0.1`` gloo stays on loopback.
    """
    info = resolve_launch_env() if info is None else info
    if dist.is_initialized():
        return info
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    # Megatron and our own code read these, whichever launcher set them.
    if info.launcher == "mpirun":
        enter_rank(torchrun_env(info.rank, info.world_size, info.master_addr, info.master_port,
                                local_rank=info.local_rank, local_world_size=info.local_world_size))
    else:  # torchrun's agent (or whoever set RANK) owns the store and the interfaces
        os.environ.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
                          MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
    return info
