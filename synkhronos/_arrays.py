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
           "round_up", "packed_views", "device_pointer", "readable_in_place", "writable_in_place",
           "still_readable", "still_writable", "cupy_at",
           "buffer_range", "span_overlaps"]


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


def _is_jax(value) -> bool:
    return (type(value).__module__ or "").startswith(("jax", "jaxlib"))


_UNKNOWN = object()


def readable_in_place(x) -> bool:
    """Whether NCCL may read ``x`` from its own device buffer, as it is: a non-empty
    C-contiguous CuPy array, or a live non-empty JAX array on one device in JAX's
    default layout (row-major, no tiles). A JAX lacking one of the attributes
    asked: False (the arrays then travel through DLPack)."""
    if _is_cupy(x):
        return bool(x.size) and bool(x.flags.c_contiguous)
    if not _is_jax(x) or not x.size:
        return False
    try:
        if x.is_deleted() or type(x.sharding).__name__ != "SingleDeviceSharding":
            return False
        layout = x.format.layout  # (row-major: dimension 0 most major)
        return tuple(layout.major_to_minor) == tuple(range(x.ndim)) and not layout.tiling
    except Exception:
        return False


def writable_in_place(x) -> bool:
    """Whether a collective may write ``x``'s result into ``x``'s own device buffer.

    An array NCCL may read in place (:func:`readable_in_place`) and, for a JAX
    array, one that holds no cached host copy: JAX arrays are immutable, so
    once ``np.asarray`` has cached a copy in host memory (on a GPU it does), a
    write into the device buffer would leave that copy stale. The copy lives
    in a private attribute (``_npy_value``): a JAX without it is never written
    into (its arrays take the route with new buffers). Anything else (numpy,
    an empty array) is False.
    """
    if not _is_cupy(x) and getattr(x, "_npy_value", _UNKNOWN) is not None:
        return False
    return readable_in_place(x)


def still_readable(x) -> bool:
    """For an array made as one :func:`readable_in_place` accepted before (of its type,
    the same compiled function's output for the same input types, so of the same
    device layout): the part of its answer that can differ from array to array."""
    if _is_cupy(x):
        return bool(x.size) and bool(x.flags.c_contiguous)
    try:
        return not x.is_deleted() and type(x.sharding).__name__ == "SingleDeviceSharding"
    except Exception:
        return False


def still_writable(x) -> bool:
    """For an array :func:`writable_in_place` accepted before: the part of its answer
    that can change while the array lives (a JAX array may since have cached a host
    copy, or been deleted)."""
    if _is_cupy(x):
        return True
    return getattr(x, "_npy_value", _UNKNOWN) is None and not x.is_deleted()


def device_pointer(x) -> int:
    """The device address of ``x``'s buffer (a CuPy or single-device JAX array).

    A JAX array is first waited for (``block_until_ready``): its buffer is
    then written, and the address is that of the value it holds.
    """
    if _is_cupy(x):
        return int(x.data.ptr)
    return int(x.block_until_ready().unsafe_buffer_pointer())


def buffer_range(x):
    """``(low, high)``, the addresses of the memory ``x`` holds (a numpy, CuPy or
    single-device JAX array); None for what holds none (not an array, empty);
    every address for a device array whose buffer cannot be read (several
    devices, deleted, an unknown JAX): it overlaps anything. Device and host
    addresses are compared alike: a false overlap only refuses a write."""
    if isinstance(x, np.ndarray):
        return byte_bounds(x) if x.size else None
    if not is_device_array(x):
        return None
    try:
        if _is_cupy(x):
            n, lo = int(x.nbytes), (int(x.data.ptr) if x.nbytes else 0)
        else:  # (JAX's nbytes property costs three times this)
            n = int(x.size) * x.dtype.itemsize
            lo = int(x.unsafe_buffer_pointer()) if n else 0
        if not n:
            return None
    except Exception:
        return 0, 1 << 64
    return lo, lo + n


def cupy_at(ptr: int, dtype, shape, owner):
    """A CuPy array over the device memory at ``ptr`` (``dtype``, ``shape``, C order),
    without a copy and without DLPack; ``owner`` is kept alive as long as the view."""
    import cupy

    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


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
    return span_overlaps(byte_bounds(a), ranges)


def span_overlaps(span, ranges) -> bool:
    """Whether the ``(low, high)`` range ``span`` overlaps any range of ``ranges``."""
    lo, hi = span
    return any(r_lo < hi and lo < r_hi for r_lo, r_hi in ranges)
