"""Checks of the world a launcher started (torchrun, mpirun, Ray, srun) against the Trainer, before the rendezvous.

Lightning's script launcher runs ``validate_settings`` for DDP; this strategy starts no launcher when the processes
exist already, so it checks here, on every rank alike, before any rank waits for another.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins import ClusterEnvironment

from lightning_autopart.errors import ConfigError

__all__ = ["check_launched_world", "refuse_mpi_without_mpi4py"]

#: World-size variables that mpirun sets in every process it starts (Open MPI; MPICH and Intel MPI's Hydra).
_MPI_WORLD_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def check_launched_world(env: ClusterEnvironment | None, devices: int, num_nodes: int) -> None:
    """Refuse a Trainer whose ``devices x num_nodes`` is not the world the launcher started: the plan places stages
    on nodes from them, and a rank's device is ``devices[local_rank]`` (else an IndexError, or a plan for one node
    on a job spread over several)."""
    if env is None or not env.creates_processes_externally:
        return
    world, local = env.world_size(), env.local_rank()
    if devices * num_nodes != world or local >= devices:
        raise ConfigError(
            f"{type(env).__name__} started {world} processes (this one has local rank {local}), but the Trainer "
            f"has devices={devices} x num_nodes={num_nodes}; pass devices=<processes per node> and "
            "num_nodes=<nodes> (torchrun: --nproc_per_node and --nnodes; mpirun, Ray, srun: processes per host and "
            "hosts)"
        )


def refuse_mpi_without_mpi4py() -> None:
    """Refuse to start Lightning's own processes in a process that mpirun started as one of several.

    Lightning sees mpirun only through ``MPIEnvironment``, which needs ``mpi4py``; without it every mpirun rank
    believes it is rank 0 and starts a whole job of its own, each training the model alone.
    """
    for name in _MPI_WORLD_VARIABLES:
        if int(os.environ.get(name) or "1") > 1:
            raise ConfigError(
                f"this process is one of the {os.environ[name]} that mpirun started ({name}), but Lightning cannot "
                "see MPI: install mpi4py (pip install mpi4py) so that it uses MPIEnvironment; without it every "
                "mpirun rank would start a separate job"
            )
