"""synk.data: arrays in shared memory, their methods, and what the workers see."""

from __future__ import annotations

import re

import numpy as np
import pytensor.tensor as pt
import pytest
from numpy.testing import assert_array_equal

import synkhronos as synk
from synkhronos._procs import shmem
from conftest import MODE, rows_of, shm_names

# ---------------------------------------------------------------------------
# creation


def test_create_from_value(fork):
    fork(2)
    a = np.arange(12, dtype=np.int32).reshape(4, 3)
    d = synk.data(a, name="ints")
    assert isinstance(d, synk.Data)
    assert d.dtype == np.int32 and d.ndim == 2 and d.shape == (4, 3) and d.size == 12
    assert d.name == "ints" and d.minibatch is False
    assert_array_equal(d.data, a)
    a[0, 0] = 99  # a copy, not a view of the caller's array
    assert d[0, 0] == 0
    lst = synk.data([[1.5, 2.5]])
    assert lst.dtype == np.float64 and lst.shape == (1, 2)


def test_create_from_var_and_dtype_ndim(fork):
    fork(2)
    x = pt.fmatrix("x")
    d = synk.data(var=x)
    assert d.dtype == np.float32 and d.ndim == 2 and d.shape == (0, 0) and d.size == 0
    assert d.alloc_size == 0 and len(d) == 0
    assert d.data.shape == (0, 0)
    # value cast to the var's dtype (float64 -> float32 lists are the same kind)
    v = synk.data([[1.0, 2.0]], var=x)
    assert v.dtype == np.float32 and v.shape == (1, 2)
    e = synk.data(dtype="int16", ndim=3, minibatch=True, name="e")
    assert e.dtype == np.int16 and e.ndim == 3 and e.shape == (0, 0, 0)
    assert e.minibatch is True and e.name == "e"
    # a 0-d array holds one element from the start, readable and writable
    z = synk.data(dtype=np.float64, ndim=0)
    assert z.shape == () and z.size == 1 and z.alloc_size == 1
    z[()] = 3.5
    junk = [np.full((), 7.0) for _ in range(10)]  # would reuse a temporary's memory
    assert z[()] == 3.5 and float(z.data) == 3.5
    del junk


def test_create_argument_errors(fork):
    fork(1)
    x = pt.dmatrix("x")
    with pytest.raises(ValueError, match="needs a value, a var, a shape, or both dtype and ndim"):
        synk.data()
    with pytest.raises(ValueError, match="needs a value"):
        synk.data(dtype="float64")
    with pytest.raises(TypeError, match="dtype='int32' conflicts with var"):
        synk.data(var=x, dtype="int32")
    with pytest.raises(ValueError, match="ndim=3 conflicts with var"):
        synk.data(var=x, ndim=3)
    with pytest.raises(ValueError, match=r"has ndim=2, but the value has ndim=1"):
        synk.data(np.ones(3), var=x)
    with pytest.raises(TypeError, match="var must be a PyTensor tensor variable, got 'x'"):
        synk.data(var="x")
    with pytest.raises(TypeError, match="cannot hold dtype object"):
        synk.data(np.array([None, 1], dtype=object))
    with pytest.raises(ValueError, match=r"ndim must be an int from 0 to \d+ \(numpy's limit\), got -1"):
        synk.data(dtype="float64", ndim=-1)
    with pytest.raises(ValueError, match=r"ndim must be an int from 0 to \d+ \(numpy's limit\), got 65"):
        synk.data(dtype="float64", ndim=65)
    with pytest.raises(ValueError, match="oversize must be a finite number >= 1, got 0.5"):
        synk.data(np.ones(3), oversize=0.5)
    with pytest.raises(ValueError, match="oversize must be a finite number >= 1, got inf"):
        synk.data(np.ones(3), oversize=float("inf"))
    with pytest.raises(ValueError, match="oversize must be a finite number >= 1, got nan"):
        synk.data(np.ones(3), oversize=float("nan"))
    d = synk.data(np.ones(3))
    for bad in (float("inf"), float("nan")):  # the methods' oversize too
        with pytest.raises(ValueError, match=f"oversize must be a finite number >= 1, got {bad}"):
            d.set_length(10, oversize=bad)
    with pytest.raises(TypeError, match="oversize must be a number >= 1, got '2'"):
        synk.data(np.ones(3), oversize="2")


# ---------------------------------------------------------------------------
# methods and properties


def test_array_protocol(fork):
    fork(1)
    d = synk.data(np.arange(10.0))
    assert len(d) == 10
    assert d[3] == 3.0
    assert_array_equal(d[2:5], [2.0, 3.0, 4.0])
    assert_array_equal(d[[9, 0]], [9.0, 0.0])
    d[0] = -1.0
    d[5:7] = [50.0, 60.0]
    assert_array_equal(d.data[:7], [-1, 1, 2, 3, 4, 50, 60])
    # data is a view into shared memory: writes through it stick
    d.data[9] = 90.0
    assert d[9] == 90.0
    assert_array_equal(np.asarray(d), d.data)
    assert np.asarray(d, dtype=np.int64).dtype == np.int64
    assert "shape=(10,)" in repr(d)
    z = synk.data(np.float64(2.0))
    with pytest.raises(TypeError, match="len"):
        len(z)


def test_set_value_and_growth_with_oversize(fork):
    fork(2)
    d = synk.data(np.arange(10.0), oversize=1.5)
    assert d.alloc_size == 15
    seg = d._seg.name
    d.set_value(np.arange(14.0))  # fits: no new segment
    assert d.shape == (14,) and d.alloc_size == 15 and d._seg.name == seg
    assert_array_equal(d.data, np.arange(14.0))
    d.set_value(np.arange(4.0) * 2)  # shrinks in place
    assert d.shape == (4,) and d.alloc_size == 15 and d._seg.name == seg
    assert_array_equal(d.data, [0, 2, 4, 6])
    d.set_value(np.arange(16.0))  # grows by the data's factor
    assert d.alloc_size == 24 and d._seg.name != seg
    assert_array_equal(d.data, np.arange(16.0))
    d.set_value(np.arange(30.0), oversize=2.0)  # a factor for this call only
    assert d.alloc_size == 60
    d.set_value(np.arange(61.0))
    assert d.alloc_size == int(61 * 1.5)
    # the old segments are gone, only the current one remains
    mine = [n for n in shm_names() if f".d{d._uid}." in n]
    assert mine == [d._seg.name]
    plain = synk.data(np.arange(10.0))
    assert plain.alloc_size == 10
    plain.set_value(np.arange(11.0))
    assert plain.alloc_size == 11


def test_set_length_keeps_rows(fork):
    fork(2)
    a = np.arange(12.0).reshape(4, 3)
    d = synk.data(a)
    d.set_length(2)
    assert d.shape == (2, 3) and d.alloc_size == 12
    assert_array_equal(d.data, a[:2])
    d.set_length(6, oversize=2.0)  # reallocates, keeps the two remaining rows
    assert d.shape == (6, 3) and d.alloc_size == 36
    assert_array_equal(d.data[:2], a[:2])
    d.set_length(0)
    assert d.shape == (0, 3) and len(d) == 0
    with pytest.raises(ValueError, match="length must be non-negative, got -1"):
        d.set_length(-1)
    with pytest.raises(TypeError, match="length must be an int, got 2.5"):
        d.set_length(2.5)


def test_set_shape_keeps_flat_contents(fork):
    fork(1)
    d = synk.data(np.arange(6.0).reshape(2, 3))
    d.set_shape((3, 2))
    assert d.shape == (3, 2) and d.alloc_size == 6
    assert_array_equal(d.data, np.arange(6.0).reshape(3, 2))
    d.set_shape([4, 4])
    assert d.shape == (4, 4) and d.alloc_size == 16
    assert_array_equal(d.data.ravel()[:6], np.arange(6.0))
    with pytest.raises(ValueError, match=r"has ndim=2, got shape \(16,\)"):
        d.set_shape((16,))
    with pytest.raises(ValueError, match=r"shape entries must be non-negative, got \(-1, 2\)"):
        d.set_shape((-1, 2))


def test_condition_data_dtype_rules(fork):
    fork(1)
    f = synk.data(dtype=np.float64, ndim=1, name="f")
    i = synk.data(dtype=np.int32, ndim=1, name="i")
    # safe casts are silent
    out = f.condition_data(np.arange(3, dtype=np.int32))
    assert out.dtype == np.float64
    assert i.condition_data(np.arange(3, dtype=np.int16)).dtype == np.int32
    assert i.condition_data([1, 2, 3]).dtype == np.int32  # Python ints, same kind
    # ... but never one the dtype cannot hold: it wrapped around (or became inf) unnoticed
    for d, value, bad in ((synk.data(dtype=np.int8, ndim=1, name="i8"), [300, 1], "300 of the value (it would become 44)"),
                          (synk.data(dtype=np.int16, ndim=0, name="i16"), 40000, "40000"),
                          (i, [2**40], str(2**40)),
                          (synk.data(dtype=np.float32, ndim=1, name="f32"), [1.0, 1e300], "1e+300"),
                          (synk.data(dtype=np.complex64, ndim=1, name="c64"), [1e300j], "1e+300j")):
        with pytest.raises(TypeError, match=rf"{d.name!r} has dtype {d.dtype}, which cannot hold {re.escape(bad)}"):
            d.condition_data(value)
        with pytest.raises(TypeError, match="force_cast=True"):
            d.set_value(value)
    with pytest.raises(TypeError, match="cannot hold 300"):
        synk.data([300], dtype=np.int8)
    assert_array_equal(synk.data([300], dtype=np.int8, force_cast=True).data, [44])  # asked for
    assert synk.data([0.1], dtype=np.float32).data[0] == np.float32(0.1)  # rounding stays allowed
    # lossy casts need force_cast
    with pytest.raises(TypeError, match=r"'i' has dtype int32; a value of dtype float64 would lose"):
        i.condition_data(np.array([1.5, 2.5]))
    with pytest.raises(TypeError, match="dtype int64 would lose information"):
        i.condition_data(np.arange(3, dtype=np.int64))
    with pytest.raises(TypeError, match="force_cast=True"):
        i.set_value([1.5])
    assert_array_equal(i.condition_data(np.array([1.7, -2.2]), force_cast=True), [1, -2])
    i.set_value(np.array([3.9, 4.1]), force_cast=True)
    assert_array_equal(i.data, [3, 4]) and i.dtype == np.int32
    # the number of dimensions never changes
    with pytest.raises(ValueError, match=r"'f' has ndim=1, but the value has ndim=2 \(shape \(1, 2\)\)"):
        f.set_value(np.ones((1, 2)))
    with pytest.raises(ValueError, match="ndim=0"):
        f.condition_data(5.0)
    # a failed set_value leaves the data as it was
    assert i.shape == (2,) and f.shape == (0,)


def test_free_memory(fork):
    fork(2)
    d = synk.data(np.ones((5, 2)))
    name = d._seg.name
    assert name in shm_names()
    d.free_memory()
    assert d.alloc_size == 0 and d.size == 0 and d.ndim == 2
    assert d.data.size == 0 and d.data.ndim == 2
    assert name not in shm_names()
    d.set_value(np.full((3, 2), 7.0))
    assert d.alloc_size == 6
    assert_array_equal(d.data, np.full((3, 2), 7.0))


def test_data_is_unusable_after_close(fork):
    fork(1)
    d = synk.data(np.ones(3), name="old")
    synk.close()
    with pytest.raises(RuntimeError, match="synk.data 'old' belongs to a fork that was closed"):
        d.data
    with pytest.raises(RuntimeError, match="belongs to a fork that was closed"):
        d.set_value(np.ones(2))
    # nor in the next fork
    fork(1)
    with pytest.raises(RuntimeError, match="belongs to a fork that was closed"):
        d[0]


# ---------------------------------------------------------------------------
# what the workers see


def test_workers_see_the_masters_writes(forked):
    n = forked
    x = pt.dmatrix("x")
    f = synk.function([x], [(x, "gather"), (x.sum(axis=0), "sum")], mode=MODE)
    d = synk.data(np.zeros((6, 2)))
    assert_array_equal(f(d)[0], np.zeros((6, 2)))
    # in place, through data and __setitem__
    d.data[:] = np.arange(12.0).reshape(6, 2)
    d[5] = [100.0, 200.0]
    want = np.arange(12.0).reshape(6, 2)
    want[5] = [100.0, 200.0]
    g, s = f(d)
    assert_array_equal(g, want)
    assert_array_equal(s, want.sum(axis=0))
    # growing reallocates: the workers map the new segment
    big = np.arange(40.0).reshape(20, 2)
    d.set_value(big)
    assert_array_equal(f(d)[0], big)
    # shrinking within the allocation
    d.set_value(big[:5] * -1)
    assert_array_equal(f(d)[0], big[:5] * -1)
    # set_length keeps rows; the new ones are written afterwards
    d.set_length(7)
    d[5:] = [[1.0, 2.0], [3.0, 4.0]]
    assert_array_equal(f(d)[0], np.vstack([big[:5] * -1, [[1.0, 2.0], [3.0, 4.0]]]))
    # freed and refilled
    d.free_memory()
    d.set_value(np.full((4, 2), 9.0))
    g, s = f(d)
    assert_array_equal(g, np.full((4, 2), 9.0))
    assert_array_equal(s, [36.0, 36.0])
    # a worker's own rows really come from the data: the reduction of a
    # per-process maximum differs from the global one
    h = synk.function([x], (x.max(), "sum"), mode=MODE)
    d.set_value(np.arange(6.0).reshape(6, 1))
    assert h(d) == sum(d.data[rows_of(6, n, r)].max() for r in range(n))


def test_zero_copy_call(forked, monkeypatch):
    """A call whose inputs are all synk.data makes no scratch segment."""
    n = forked
    x = pt.dmatrix("x")
    w = pt.dvector("w")
    f = synk.function([x, w], [((x * w).sum(axis=0), "sum"), (x, "gather")], bcast_inputs=[w],
                      mode=MODE)
    a = np.arange(24.0).reshape(8, 3)
    dx, dw = synk.data(a), synk.data(np.array([1.0, 2.0, 3.0]))
    f(dx, dw)  # first call: the communicator's own segments appear
    before = shm_names()
    created = []
    orig_init = shmem.Segment.__init__

    def counting_init(self, name, size=None, create=False, **kw):
        if create:
            created.append(name)
        orig_init(self, name, size, create, **kw)

    monkeypatch.setattr(shmem.Segment, "__init__", counting_init)
    dx.data[:] = a * 2
    for batch in (None, slice(1, 7), 5):
        total, gathered = f(dx, dw, batch=batch)
        rows = (a * 2)[slice(None) if batch is None else
                       (batch if isinstance(batch, slice) else slice(0, batch))]
        assert_array_equal(gathered, rows)
        assert_array_equal(total, (rows * [1.0, 2.0, 3.0]).sum(axis=0))
    assert f._scratch == {}
    assert created == [], f"the master made segments during zero-copy calls: {created}"
    assert shm_names() == before
    # the same call with numpy inputs goes through scratch memory when workers need it
    total, gathered = f(a, np.array([1.0, 2.0, 3.0]))
    assert_array_equal(gathered, a)
    if n > 1:
        assert f._scratch != {}
        assert created, "numpy inputs are copied to shared memory for the workers"
    else:
        assert f._scratch == {}, "one process alone needs no shared copy of numpy inputs"
