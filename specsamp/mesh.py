"""The device mesh of a worker: `tensor_parallel` devices on one axis, "tp".

Tensor parallelism here is within one host: the mesh takes the first N of
`jax.devices()` (on a multi-host job, `jax.local_devices()`; see docs/sharding.md for what
a mesh across hosts would need). N = 1 means no mesh: programs and placement stay exactly
as on a single device.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from specsamp.errors import UserError

AXIS = "tp"


def check_tensor_parallel(n) -> int:
    """`n` as a tensor-parallel degree (an integer >= 1), or a UserError."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise UserError(f"tensor parallel must be an integer >= 1, got {n!r}")
    return n


def make_mesh(n: int) -> Mesh | None:
    """A 1-D mesh over this process's first `n` devices (None for n = 1)."""
    check_tensor_parallel(n)
    if n == 1:
        return None
    devices = jax.local_devices()
    if n > len(devices):
        raise UserError(
            f"tensor parallel {n} needs {n} devices, but this worker has {len(devices)} "
            f"({devices[0].platform}); on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} "
            f"simulates them")
    return Mesh(np.array(devices[:n]), (AXIS,))


def replicate(tree, mesh: Mesh | None):
    """Every array of `tree` copied to all devices of the mesh (small decode state)."""
    if mesh is None or tree is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))
