"""This process's JAX, as every device sees it: whether its backends are up,
whether a PyTensor linker runs through JAX, and the mode a function of JAX mode
runs in where JAX cannot run (none of them imports JAX)."""

from __future__ import annotations

import sys

__all__ = []

#: The tag of the rewrites that turn a graph made for JAX mode into one PyTensor's own
#: backend runs without JAX (an Op whose ``perform`` would call JAX expanded into
#: PyTensor's graph): applied only by :func:`host_mode`.
HOST_REWRITES = "synk_host"


def host_mode():
    """The PyTensor mode of a JAX-mode function's share inside an XLA host callback, where
    JAX cannot run (see ``_state.inside_xla_callback``): PyTensor's default backend
    (FAST_RUN: C where a compiler is found, else Python) with the rewrites tagged
    :data:`HOST_REWRITES`."""
    from pytensor.compile.mode import get_mode

    return get_mode("FAST_RUN").including(HOST_REWRITES)


def jax_linker(linker) -> bool:
    """Whether a PyTensor linker (a Mode's, or a compiled function's) runs through JAX
    (imports no JAX)."""
    from pytensor.link.jax.linker import JAXLinker

    return isinstance(linker, JAXLinker)


def jax_backends_up() -> bool:
    if sys.modules.get("jax") is None:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # a JAX without this query: nothing to check against
        return False
