"""Launch bootstrap (torchrun / mpirun environments) and the up-front refusals of initialize_model_parallel."""

import pytest

from entr_megatron.parallel import groups

TORCHRUN = dict(RANK="3", WORLD_SIZE="8", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500", LOCAL_RANK="1")


class FakeComm:
    """mpi4py's COMM_WORLD as seen by one rank: bcast returns rank 0's object."""

    def __init__(self, rank, size, root_object=None):
        self.rank, self.size, self.root_object = rank, size, root_object

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def bcast(self, obj, root=0):
        assert root == 0
        return obj if self.rank == 0 else self.root_object


def test_torchrun_environment():
    info = groups.resolve_launch_env(TORCHRUN)
    assert info == groups.LaunchInfo(3, 8, 1, "10.0.0.1", 29500, "torchrun")


def test_missing_torchrun_variables_are_named():
    env = dict(TORCHRUN)
    del env["MASTER_PORT"], env["WORLD_SIZE"]
    with pytest.raises(ValueError, match="WORLD_SIZE, MASTER_PORT not set"):
        groups.resolve_launch_env(env)
    with pytest.raises(ValueError, match="RANK must be in"):
        groups.resolve_launch_env(dict(TORCHRUN, RANK="8"))
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer"):
        groups.resolve_launch_env(dict(TORCHRUN, MASTER_PORT="x"))


def test_mpirun_rank_zero_broadcasts_its_address():
    env = dict(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_LOCAL_RANK="0", MASTER_PORT="29600", MASTER_ADDR="node0")
    root = groups.resolve_launch_env(env, mpi_comm=FakeComm(0, 4))
    assert (root.rank, root.world_size, root.master_addr, root.master_port, root.launcher) == (0, 4, "node0", 29600, "mpirun")
    other = groups.resolve_launch_env(dict(PMI_RANK="2", MPI_LOCALRANKID="1"), mpi_comm=FakeComm(2, 4, ("node0", 29600)))
    assert other == groups.LaunchInfo(2, 4, 1, "node0", 29600, "mpirun")


def test_mpirun_picks_a_port_when_none_is_given():
    info = groups.resolve_launch_env(dict(OMPI_COMM_WORLD_RANK="0"), mpi_comm=FakeComm(0, 1))
    assert 0 < info.master_port < 65536 and info.master_addr


def test_torchrun_variables_win_over_mpi_ones():
    assert groups.resolve_launch_env(dict(TORCHRUN, OMPI_COMM_WORLD_RANK="0")).launcher == "torchrun"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tp=0), "tp must be a positive integer"),
        (dict(vpp=2), "vpp=2 .* needs pp >= 2"),
        (dict(cp=2), "cp=2: context parallelism needs TransformerEngine"),
    ],
)
def test_bad_layouts_are_refused_before_any_collective(kwargs, match):
    if "cp" in kwargs and groups._have_transformer_engine():
        pytest.skip("TransformerEngine is installed: CP is allowed")
    with pytest.raises(ValueError, match=match):
        groups.initialize_model_parallel(**kwargs)
