"""Module-level worker classes for tests/unit/test_controller_workers.py (spawned processes import them)."""

import os


class EchoWorker:
    def __init__(self, tag):
        self.tag = tag
        self.rank = int(os.environ["RANK"])

    def whoami(self):
        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}

    def getenv(self, names):
        return {name: os.environ.get(name) for name in names}

    def add(self, x, y=0):
        return self.tag, self.rank, x + y + self.rank

    def fail_on(self, rank):
        if self.rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return "fine"

    def pid(self):
        return os.getpid()

    def fork_and_wait(self, seconds, pid_file):
        """What Megatron's checkpoint writers are: a forked child (its pid written to `pid_file`)
        the call waits for; returns its exit code."""
        import multiprocessing
        import time

        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(seconds,))
        child.start()
        with open(pid_file, "w") as f:
            f.write(str(child.pid))
        child.join()
        return child.exitcode

    def die_on(self, rank):
        if self.rank == rank:
            os._exit(3)
        import time

        time.sleep(30)  # a peer waiting in a collective that will never complete


def make_echo(tag):
    return EchoWorker(tag)


def make_broken(tag):
    raise RuntimeError(f"cannot build {tag}")


def _save_fails(self, step):
    """What a full disk does to a rank's save: the one-line CheckpointSaveError (issue 46)."""
    from entr_megatron.checkpoint.directory import CheckpointSaveError

    raise CheckpointSaveError(f"saving the checkpoint of step {step} failed: no space left on device (ENOSPC)")


EchoWorker.save_fails = _save_fails
