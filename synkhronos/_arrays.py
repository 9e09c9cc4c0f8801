"""Array helpers shared by every layer: conversions between numpy, CuPy and
JAX, the one concatenation of gathered parts, and byte ranges of arrays.

CuPy and JAX are imported inside the functions that need them, never at
module import.
"""

from __future__ import annotations

import math

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy < 2
    byte_bounds = np.byte_bounds  # type: ignore[attr-defined, unused-ignore]  # (not in numpy 2's stubs)

__all__ = ["to_cupy", "to_jax", "to_numpy", "is_device_array", "concat", "join", "byte_bounds", "overlaps",
           "round_up", "packed_views"]


def round_up(n: int, to: int = 64) -> int:
    """``n`` rounded up to a multiple of ``to`` (by default a cache line, 64 bytes)."""
    return -(-n // to) * to


def packed_views(buf: np.ndarray, layout, offset: int, align: int) -> list:
    """Views of ``buf`` (a uint8 array) for arrays of ``layout`` (``(dtype,
    shape)`` pairs) laid out one after the other from byte ``offset``, each
    starting on an ``align``-byte boundary."""
    views = []
    for dtype, shape in layout:
        n = math.prod(shape) * dtype.itemsize
        views.append(buf[offset:offset + n].view(dtype).reshape(shape))
        offset = round_up(offset + n, align)
    return views


def is_device_array(value) -> bool:
    """A JAX or CuPy array (checked without importing either)."""
    return (type(value).__module__ or "").startswith(("jax", "jaxlib", "cupy"))


def _is_cupy(value) -> bool:
    return (type(value).__module__ or "").startswith("cupy")


def to_cupy(x):
    """A CuPy array of ``x``: JAX arrays through DLPack (no copy), numpy copied to the device."""
    import cupy

    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack__"):
        return cupy.from_dlpack(x)
    return cupy.asarray(np.asarray(x))


def to_jax(x, device=None):
    """A JAX array of ``x``: CuPy arrays through DLPack (no copy), numpy copied to ``device``."""
    import jax

    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray) or np.isscalar(x):
        return jax.device_put(np.asarray(x), device)
    if x.size == 0:  # nothing to share, and an empty buffer may have no address to import
        return jax.device_put(np.empty(x.shape, dtype=x.dtype), device)
    try:
        return jax.dlpack.from_dlpack(x)
    except AttributeError:  # a JAX whose dlpack module lacks from_dlpack
        import jax.numpy as jnp

        return jnp.from_dlpack(x)


def to_numpy(x):
    """A numpy array of ``x`` (a copy from the device for JAX and CuPy arrays); None stays None."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if _is_cupy(x):
        return x.get()
    return np.asarray(x)


def concat(parts):
    """Concatenate gathered parts along axis 0 (0-d parts are stacked); None
    parts are skipped, and None comes back when nothing is left. CuPy parts
    stay on their GPU; anything else becomes numpy."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    if _is_cupy(parts[0]):
        import cupy as xp
    else:
        xp, parts = np, [np.asarray(p) for p in parts]
    if parts[0].ndim == 0:
        return xp.stack(parts)
    return xp.concatenate(parts, axis=0)


def join(parts, nd_up, var):
    """The gathered values of shared variable ``var``: stacked on a new axis
    (``nd_up=1``, equal shapes only) or concatenated along axis 0 (``nd_up=0``)."""
    if nd_up == 1:
        shapes = {p.shape for p in parts}
        if len(shapes) > 1:
            raise ValueError(f"gather(nd_up=1) needs equal shapes, but shared variable "
                             f"{var.name or var!r} has shapes {[p.shape for p in parts]}; use nd_up=0")
        first = parts[0]
        if not first.dtype.isnative or any(p.dtype != first.dtype for p in parts):
            return np.stack(parts)  # (the common native dtype, as numpy finds it)
        out = np.empty((len(parts),) + first.shape, first.dtype)  # np.stack's result, without its ~2 us
        for i, p in enumerate(parts):
            out[i] = p
        return out
    if parts[0].ndim == 0:
        raise ValueError(f"gather(nd_up=0) cannot concatenate 0-d shared variable {var.name or var!r}")
    return np.concatenate(parts, axis=0)


def overlaps(a, ranges) -> bool:
    """Whether the bytes of array ``a`` overlap any ``(low, high)`` range of ``ranges``."""
    lo, hi = byte_bounds(a)
    return any(r_lo < hi and lo < r_hi for r_lo, r_hi in ranges)
