"""This process's JAX, as every device sees it: whether its backends are up, and
whether a PyTensor linker runs through JAX (neither imports JAX)."""

from __future__ import annotations

import sys

__all__ = []


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
