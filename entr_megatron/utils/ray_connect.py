"""`ray.init` for the three places that start or join a Ray cluster (the learner's worker group,
the job's engines, a study's cells), with one error for an address Ray cannot join.

`config.launcher.check_ray_reachable` probes the address with a TCP connection before anything
starts; this is the second wall: something may accept TCP there without being a Ray head (a
proxy, another service), and Ray then retries for about half a minute and raises a bare
ConnectionError. Here that error names the field and what would be valid.
"""

from __future__ import annotations

__all__ = ["RayConnectError", "connect_ray"]


class RayConnectError(ConnectionError):
    """Ray could not join the cluster at the configured address."""


def connect_ray(address: str | None, field: str = "launcher.ray_address", install_hint: str = "launcher.kind='ray'",
                **init_kwargs):
    """Imports ray and joins (or, with address None or 'local', starts) its cluster once per process;
    returns the ray module. Raises ImportError naming `install_hint`, RayConnectError naming `field`."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"{install_hint} needs Ray: pip install 'entr-megatron[cluster]'") from e
    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, **init_kwargs)
        except ConnectionError as e:
            raise RayConnectError(
                f"{field}={address!r}: Ray could not join a cluster there ({e}). Is a Ray head running "
                "(ray start --head) and the address its GCS port (HOST:6379), or ray://HOST:10001 for Ray "
                "Client? Use 'local' (or leave it out) for a cluster on this machine.") from None
    return ray
