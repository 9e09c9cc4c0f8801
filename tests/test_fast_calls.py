"""The per-call fast path (issue 18) gives exactly what the full path gives.

Planned calls (the same message resent, the workers' kept share), outputs
that ride back in the reply areas, outputs too big for them, and the waits'
knob: each is compared with plain PyTensor over many random calls.
"""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest
from pytensor.raise_op import Assert

import synkhronos as synk
from synkhronos._protocol.control import REPLY_CAP

from conftest import MODE, shm_names


def _function():
    """Outputs of every op over a scattered matrix and a broadcast vector."""
    x = pt.dmatrix("x")
    v = pt.dvector("v")
    outs = [((x * v).mean(), "avg"), (x.max(), "max"), (x.min(axis=0), "min"), ((x + 1).prod(), "prod"),
            (x.sum(axis=1), "gather"), (x.shape[0], "sum"), (v.mean(), None), ((x > 0).mean(), "avg")]
    return synk.function([x, v], outs, bcast_inputs=[v], mode=MODE)


def _check(got, want, where):
    assert len(got) == len(want), where
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, f"{where}, output {k}: shape {g.shape} != {w.shape}"
        assert g.dtype == w.dtype, f"{where}, output {k}: dtype {g.dtype} != {w.dtype}"
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{where}, output {k}")


def test_planned_calls_match_pytensor_as_values_and_shapes_change(forked, rng):
    """Loops of calls with new values each time, the shapes switching now and then,
    numpy and synk.data inputs mixed: every call equals plain PyTensor."""
    f = _function()
    datas = {}
    rows = 4
    for i in range(120):
        if i % 10 == 0:
            rows = int(rng.choice([1, 2, 5, 7, 16]))
        x = rng.standard_normal((rows, 3))
        v = rng.standard_normal(3)
        if i % 3 == 2:  # a synk.data input, its values rewritten in place between calls
            d = datas.get(rows)
            if d is None:
                d = datas[rows] = synk.data(x)
            else:
                d.data[...] = x
            got = f(d, v)
        else:
            got = f(x, v)
        _check(got, f.as_pytensor(x, v), f"call {i} ({rows} rows, {forked} processes)")
    for d in datas.values():
        d.free_memory()


def test_inputs_with_static_shapes_are_planned_and_still_checked(forked, rng):
    """An input with a static shape (PyMC's ``shape=K`` parameters, ``pt.tensor(shape=...)``)
    is planned like the others when its value has that shape: random loops equal plain
    PyTensor, and a value of another shape is refused with PyTensor's error on every call,
    planned or not, never computed."""
    x = pt.dmatrix("x")
    w = pt.tensor("w", dtype="float64", shape=(3,))
    c = pt.tensor("c", dtype="float64", shape=(None, 2))
    f = synk.function([x, w, c], [((x @ w).sum(), "sum"), ((x @ w).max() + c.sum(), "max")],
                      bcast_inputs=[w, c], mode=MODE)
    for i in range(60):
        rows = int(rng.choice([1, 3, 8]))
        x_, w_, c_ = rng.standard_normal((rows, 3)), rng.standard_normal(3), rng.standard_normal((i % 4, 2))
        _check(f(x_, w_, c_), f.as_pytensor(x_, w_, c_), f"call {i} ({rows} rows, {forked} processes)")
        if i % 20 == 19:
            assert f._planned, "calls with static-shaped inputs are planned"
            with pytest.raises(TypeError, match="shape"):
                f(x_, rng.standard_normal(4), c_)
            with pytest.raises(TypeError, match="shape"):
                f(x_, w_, rng.standard_normal((2, 3)))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_lanes_give_the_bits_of_the_communicator_path(forked, rng, dtype):
    """The same graph twice: one function's outputs ride back inline (its planned
    calls run as lanes), the other's always go through the shared-memory
    communicator. Every output of every call has the same bytes, also with
    fewer rows than processes (a worker with nothing to add) and with the
    rows per process uneven (avg weights)."""
    def build():
        x = pt.matrix("x", dtype=dtype)
        v = pt.vector("v", dtype=dtype)
        outs = [((x * v).mean(), "avg"), (x.max(), "max"), (x.min(axis=0), "min"),
                ((x + 1).prod(axis=0), "prod"), (x.sum(axis=1), "gather"), (x.shape[0], "avg"),
                ((x > 0).mean(), "avg"), ((x * v).sum(), "sum"), (x.sum(), None), (x[:, 0].mean(), "avg")]
        return synk.function([x, v], outs, bcast_inputs=[v], mode=MODE)

    inline, through_comm = build(), build()
    through_comm._spilled.add(None)  # never inline: the communicator reduces every call
    rows = 4
    for i in range(90):
        if i % 6 == 0:
            rows = int(rng.choice([1, 2, 3, 5, 8, 13]))
        x = (rng.standard_normal((rows, 3)) * 10.0 ** rng.integers(-3, 4)).astype(dtype)
        v = rng.standard_normal(3).astype(dtype)
        got, want = inline(x, v), through_comm(x, v)
        for k, (g, w) in enumerate(zip(got, want)):
            g, w = np.asarray(g), np.asarray(w)
            assert (g.dtype, g.shape) == (w.dtype, w.shape), (i, k)
            assert g.tobytes() == w.tobytes(), f"call {i} ({rows} rows), output {k}: {g!r} != {w!r}"
    assert inline._planned and all(p.lane is not None for p in inline._planned.values())


def test_planned_calls_see_a_resized_data_input(forked):
    x = pt.dvector("x")
    f = synk.function([x], (x.sum(), "sum"), mode=MODE)
    d = synk.data(np.ones(10))
    for _ in range(3):
        assert f(d) == 10
    d.set_value(np.arange(1000.0))  # new memory: the old plan must not be used
    for _ in range(3):
        assert f(d) == sum(range(1000))
    d.set_value(np.full(4, 2.0))
    assert f(d) == 8
    d.free_memory()


def test_functions_alternating_in_a_loop(forked, rng):
    """Two functions called in turn: each call sends a different message, which
    the workers must not mistake for the one they kept."""
    x = pt.dvector("x")
    f = synk.function([x], (x.sum(), "sum"), mode=MODE)
    g = synk.function([x], (x.max(), "max"), mode=MODE)
    for i in range(60):
        a = rng.standard_normal(int(rng.integers(3, 9)))
        assert f(a) == pytest.approx(a.sum(), rel=1e-12, abs=1e-12)
        assert g(a) == a.max()


@pytest.mark.parametrize("op", ["avg", "sum", "max", "gather"])
def test_outputs_too_big_for_the_reply_area(forked, rng, op):
    """An output larger than a reply area goes through a segment of its own once,
    then through the communicator: the same values every time, nothing left."""
    n = REPLY_CAP  # float64: 8 bytes each, far more than the area holds per rank
    x = pt.dmatrix("x")
    out = x if op == "gather" else x.sum(axis=0)
    f = synk.function([x], (out, op), mode=MODE)
    for i in range(4):
        a = rng.standard_normal((2 * forked + i, n))
        got = f(a)
        if op == "gather":
            want = a
        else:
            parts = np.array_split(a, forked)
            sums = [p.sum(axis=0) for p in parts]
            want = {"sum": a.sum(axis=0), "max": np.max(sums, axis=0),
                    "avg": sum(len(p) * s for p, s in zip(parts, sums)) / len(a)}[op]
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_worker_error_in_a_planned_call_comes_home_and_the_next_call_works(fork):
    fork(2)
    x = pt.dvector("x")
    f = synk.function([x], (Assert("negative input")(x, pt.all(x >= 0)).sum(), "sum"), mode=MODE)
    assert f(np.ones(4)) == 4
    assert f(np.ones(4)) == 4  # planned
    bad = np.ones(4)
    bad[3] = -1.0  # in rank 1's rows only
    with pytest.raises(AssertionError, match="negative input") as info:
        f(bad)
    assert getattr(info.value, "synk_rank", None) == 1
    assert f(np.ones(4)) == 4


def test_mismatched_output_shapes_in_an_inline_reduction_are_refused(fork):
    fork(2)
    x = pt.dmatrix("x")
    f = synk.function([x], (x * 1.0, "sum"), mode=MODE)
    with pytest.raises(ValueError, match=r"cannot sum-reduce: rank 0 holds .*\(2, 2\).* but rank 1 holds "
                                         r".*\(1, 2\)"):
        f(np.ones((3, 2)))
    assert f(np.ones((4, 2))).tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_kept_combines_follow_output_shapes_that_change_with_the_values(fork, rng):
    """Output shapes that follow the input values, not the plan: the master's,
    a worker's or both change from one planned call to the next. The master's
    kept combine must notice either; processes that disagree are refused,
    never summed into a wrong shape."""
    fork(2)
    k = pt.lvector("k")  # scattered, two rows per process: each one's first row is its output length
    out = pt.arange(k[0]).astype("float64") + k[0]
    f = synk.function([k], [(out, "sum"), (out, "avg"), (k.sum(), "sum")], mode=MODE)
    m = 3
    for i in range(150):
        if rng.random() < 0.3:
            m = int(rng.integers(0, 6))
        w = m if rng.random() < 0.8 else int(rng.integers(0, 6))
        a = np.array([m, 1, w, 1])
        if w == m:
            want = np.arange(m) + float(m)
            got = f(a)
            assert got[0].shape == (m,) and got[1].shape == (m,), (i, m)
            assert got[0].tobytes() == (2 * want).tobytes(), (i, m)
            assert got[1].tobytes() == want.tobytes(), (i, m)
            assert got[2] == a.sum()
        else:
            with pytest.raises(ValueError, match=rf"cannot (sum|avg)-reduce: rank 0 holds .*\({m},\).* "
                                                 rf"but rank 1 holds .*\({w},\)"):
                f(a)


@pytest.mark.parametrize("window", [3, None])
def test_loops_over_more_messages_than_the_workers_keep(fork, rng, monkeypatch, window):
    """Calls of three functions and inline collectives of many kinds, in a loop
    that goes through more kept messages than the workers keep (``window``
    shrinks what they keep, so that the master sends forgotten ones again in
    full): every call and collective gives what numpy gives."""
    from synkhronos._protocol import control
    if window is not None:
        monkeypatch.setattr(control, "KEEP_WINDOW", window)  # before fork(): the workers inherit it
    n = fork(3)
    x = pt.dvector("x")
    fs = [synk.function([x], (x.sum() + k, "sum"), mode=MODE) for k in range(5)]
    vs = [pytensor.shared(np.zeros(2), name=f"v{k}") for k in range(3)]
    synk.function([], sum(v.sum() for v in vs), mode=MODE)
    synk.distribute()
    for i in range(200):  # calls alone: kept messages only, sent again, forgotten and sent anew
        k = int(rng.integers(len(fs)))
        a = rng.standard_normal(6)
        assert fs[k](a) == pytest.approx(a.sum() + n * k, rel=1e-12, abs=1e-12), (i, k)
    steps = [("f", k) for k in range(3)] + [("all_reduce", op) for op in ("sum", "max", "min", "avg")] + \
            [("broadcast", k) for k in range(3)] + [("reduce", op) for op in ("sum", "prod")]
    for i in range(4 * len(steps)):
        kind, arg = steps[int(rng.integers(len(steps)))] if i >= len(steps) else steps[i]
        if kind == "f":
            a = rng.standard_normal(6)
            got, want = fs[arg](a), a.sum() + n * arg
            assert got == pytest.approx(want, rel=1e-12, abs=1e-12), (i, kind, arg)
            continue
        values = [rng.standard_normal(2) for _ in range(n)]
        for r in range(n):
            synk.set_value(r, vs, [values[r] * (k + 1) for k in range(3)])
        if kind == "broadcast":  # all of vs[:2], or vs[1] or vs[2] alone
            synk.broadcast(vs[:2] if arg == 0 else vs[arg])
            for r in range(n):
                for k in ((0, 1) if arg == 0 else (arg,)):
                    np.testing.assert_allclose(synk.get_value(r, vs[k]), values[0] * (k + 1), rtol=1e-12,
                                               err_msg=f"{i}: broadcast {arg}, rank {r}, v{k}")
            continue
        if kind == "all_reduce":
            synk.all_reduce(vs[:2], op=arg)
            want = {"sum": np.sum, "max": np.max, "min": np.min, "avg": np.mean}[arg](values, axis=0)
        else:
            got = synk.reduce(vs[:2], op=arg, in_place=False)
            want = {"sum": np.sum, "prod": np.prod}[arg](values, axis=0)
            np.testing.assert_allclose(got[0], want, rtol=1e-12, err_msg=f"{i}: reduce {arg}")
            continue
        for r in range(n):
            np.testing.assert_allclose(synk.get_value(r, vs[0]), want, rtol=1e-12, err_msg=f"{i}: {kind} {arg}")


def test_alternating_functions_see_a_resized_data_input(forked):
    """Two functions in turn on one synk.data input, which is given new memory:
    the workers' kept calls of both must let go of the old memory."""
    x = pt.dvector("x")
    f = synk.function([x], (x.sum(), "sum"), mode=MODE)
    g = synk.function([x], (x.max(), "max"), mode=MODE)
    d = synk.data(np.ones(12))
    for _ in range(3):
        assert f(d) == 12 and g(d) == 1
    d.set_value(np.arange(1000.0))
    for _ in range(3):
        assert f(d) == sum(range(1000)) and g(d) == 999
    d.set_value(np.full(6, 2.0))
    assert f(d) == 12 and g(d) == 2
    d.free_memory()


def test_reply_areas_read_what_was_written_as_layouts_change(rng):
    """One process's reply area as its writer and its reader see it (two views of
    one buffer, as the worker and the master map it): layouts that change,
    stay, shrink to nothing or go elsewhere and back always read back right."""
    from synkhronos._protocol.replies import INLINE, ReplyArea
    buf = np.zeros(REPLY_CAP, np.uint8)
    writer, reader = ReplyArea(buf), ReplyArea(buf)
    kinds = [("float32", (4,)), ("float64", ()), ("int64", (2, 3)), (">f4", (4,)), ("float32", (5,))]
    for i in range(300):
        if rng.random() < 0.1:
            writer.put_elsewhere(i)
            assert reader.state() != INLINE and reader.inline() is None and reader.generation() == i
            continue
        picked = [kinds[j] for j in rng.integers(0, len(kinds), int(rng.integers(0, 3)))]
        arrays = [rng.standard_normal(shape).astype(dtype) for dtype, shape in picked]
        weight = float(rng.integers(1, 9))
        assert writer.put(arrays, weight)
        assert reader.state() == INLINE
        got, got_weight = reader.inline()
        assert got_weight == weight and len(got) == len(arrays), i
        for g, a in zip(got, arrays):
            assert g.shape == a.shape and g.dtype == a.dtype.newbyteorder("=") and (g == a).all(), i
    assert not writer.put([np.zeros(REPLY_CAP)], 1.0)  # too big: nothing written, the last values stay
    assert [g.tolist() for g in reader.inline()[0]] == [a.tolist() for a in arrays]


def test_inline_areas_read_what_was_written_as_layouts_change(rng):
    """One process's inline area as its writer and two readers see it: layouts
    that change, come back, grow past the area (layout alone), or do not even
    fit as a layout always read back right; a reader that missed writes too."""
    from synkhronos.collectives.inline import LAYOUT, OVERSIZE, VALUES, InlineArea
    buf = np.zeros(4096, np.uint8)
    writer, reader, late = InlineArea(buf), InlineArea(buf), InlineArea(buf)
    kinds = [("float32", (4,)), ("float64", ()), ("int64", (2, 3)), (">f4", (4,)), ("float32", (5,)),
             ("float64", (600,)), ("int8", (1,) * 40)]
    for i in range(400):
        picked = [kinds[j] for j in rng.integers(0, len(kinds), int(rng.integers(1, 4)))]
        arrays = [rng.standard_normal(shape).astype(dtype) for dtype, shape in picked]
        layout = tuple((a.dtype, a.shape) for a in arrays)
        wrote = writer.write(arrays, layout if rng.random() < 0.5 else None)
        need = sum(2 + len(s) for _, s in layout) * 8 + 32
        for r in ([reader, late] if rng.random() < 0.3 else [reader]):
            state, got, got_layout = r.read()
            if not wrote:
                assert state == (OVERSIZE if need > 4096 else LAYOUT), i
                if state == LAYOUT:
                    assert got is None and got_layout == tuple((np.dtype(d), s) for d, s in picked), i
                continue
            assert state == VALUES and got_layout == layout and len(got) == len(arrays), i
            for g, a in zip(got, arrays):
                assert g.shape == a.shape and g.dtype == a.dtype and (g == a).all(), i

@pytest.mark.parametrize("value, err, match", [
    (-1.0, ValueError, "idle_spin must be a finite number of seconds >= 0, got -1.0"),
    (float("inf"), ValueError, "idle_spin must be a finite number"),
    ("0.1", TypeError, "idle_spin must be a number of seconds or None, got '0.1'"),
    (True, TypeError, "idle_spin must be a number of seconds or None, got True"),
])
def test_bad_idle_spin(value, err, match):
    with pytest.raises(err, match=match):
        synk.fork(2, device="cpu", idle_spin=value)
    assert synk._state.current() is None


@pytest.mark.parametrize("idle_spin", [0, 0.0005])
def test_workers_that_sleep_at_once_still_answer(fork, idle_spin):
    fork(2, idle_spin=idle_spin)
    x = pt.dvector("x")
    f = synk.function([x], (x.sum(), "sum"), mode=MODE)
    import time
    for i in range(20):
        time.sleep(0.002 * (i % 3))
        assert f(np.full(6, float(i))) == 6 * i


def test_small_outputs_take_no_collective(fork):
    """Small outputs ride back with the answers: the communicator never publishes
    (its slot segments are made at the first collective)."""
    fork(2)
    x = pt.dvector("x")
    f = synk.function([x], [(x.sum(), "sum"), (x.mean(), "avg"), (x, "gather")], mode=MODE)
    for i in range(10):
        got = f(np.arange(6.0) + i)
        assert got[0] == 15 + 6 * i and got[1] == 2.5 + i
        assert got[2].tolist() == (np.arange(6.0) + i).tolist()
    assert not [n for n in shm_names() if ".c.slot" in n]
    s = pytensor.shared(np.zeros(3), name="s")
    synk.function([], (s.sum(), None), mode=MODE)
    synk.distribute()
    synk.get_shapes(s)  # a collective through the communicator does make them (small all_reduce goes inline)
    assert [n for n in shm_names() if ".c.slot" in n]
