"""synk.data by reference, as commands carry it: a process maps a Data ref in
place (:func:`attach`) and closes the mappings the master dropped (:func:`forget`)."""

from __future__ import annotations

import numpy as np

from .._procs.shmem import Segment

__all__ = []


def attach(proc, ref) -> np.ndarray:
    """In any process: the array a Data ref points to (cached mapping and view, no copy)."""
    uid, segname, dtype, shape = ref
    if segname is None:
        return np.empty(shape, dtype=dtype)
    hit = proc.data_cache.get(uid)
    if hit is not None and hit[0].name == segname:
        seg, views = hit
        view = views.get((dtype, shape))
        if view is None:
            if len(views) >= 8:  # shapes keep changing (scratch inputs): keep few
                views.clear()
            view = views[(dtype, shape)] = seg.array(dtype, shape)
        return view
    if hit is not None:
        hit[0].close()
    seg = Segment(segname)
    view = seg.array(dtype, shape)
    proc.data_cache[uid] = (seg, {(dtype, shape): view})
    return view


def forget(proc, uids) -> None:
    """Close the mappings of Data objects the master reallocated or freed (and
    forget the kept calls, whose shares may hold views of them)."""
    if uids:
        proc.kept.forget_calls()
    for uid in uids:
        hit = proc.data_cache.pop(uid, None)
        if hit is not None:
            hit[0].close()
