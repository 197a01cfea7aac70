"""Which Ray a loader's tasks run on: the cluster ``RayOptions.address`` (or ``RAY_ADDRESS``)
names, the one this process already joined, or a local one started on demand — on the loopback
address only — and shut down when the last loader that uses it is closed."""

from __future__ import annotations

import logging
import os
import threading

from ...core._config import RayOptions
from ...runtime._dist import cpu_cores

__all__ = ["attach", "detach", "local_cpus", "LOOPBACK_ENV"]

log = logging.getLogger("gpupipe")

# Ray resolves 127.0.0.1 to the machine's interface address unless told that this "cluster" is a
# local one (its switch for Windows and macOS): a local Ray then binds and talks on loopback only.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

_lock = threading.Lock()
_users = 0  # loaders attached to the local Ray this process started
_started = False


def attach(options: RayOptions) -> None:
    """Joins (or starts) the Ray ``options`` say, once per process; counts the loaders that use a
    local Ray gpupipe started."""
    global _users, _started
    with _lock:
        import ray

        if ray.is_initialized():
            _users += _started
            return
        address = options.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
            log.info("gpupipe ray: joined the Ray cluster at %s", address)
            return
        if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
            log.warning(
                "gpupipe ray: no Ray address (RayOptions.address, RAY_ADDRESS) under %s ranks: this rank starts a "
                "local Ray of its own; for one cluster shared by every rank, start it (ray start --head) and set "
                "RAY_ADDRESS",
                os.environ["WORLD_SIZE"],
            )
        os.environ.update(LOOPBACK_ENV)  # before ray reads it (its workers inherit it too)
        _reload_constants()
        ray.init(
            address="local",  # a new one, never a cluster some earlier process left its address of
            num_cpus=options.local_cpus or cpu_cores(),
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        _started, _users = True, 1
        log.info("gpupipe ray: started a local Ray (loopback, %s CPUs)", ray.cluster_resources().get("CPU"))


def local_cpus() -> float | None:
    """The CPUs of the local Ray gpupipe started (``None``: another Ray, whose nodes may come and
    go): a task that asks for more never runs."""
    with _lock:
        if not _started:
            return None
        import ray

        return float(ray.cluster_resources().get("CPU", 0.0))


def detach() -> None:
    """A loader is done with Ray: the local Ray gpupipe started ends with the last one."""
    global _users, _started
    with _lock:
        if not _started:
            return
        _users -= 1
        if _users <= 0:
            import ray

            if ray.is_initialized():
                ray.shutdown()
            _started, _users = False, 0
            log.info("gpupipe ray: the local Ray is shut down")


def _reload_constants() -> None:
    """Ray reads the loopback switch when ``ray_constants`` is imported: set it there too."""
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
