"""A model-based random test of synkhronos.multiverso's tables, run as a script (SPMD).

    python model_tables.py SEED STEPS SYNC NUM_WORKERS [TOKEN]
    mpirun -np N python model_tables.py SEED STEPS SYNC 0 [TOKEN]

Every worker draws the same random steps from SEED (``SYNC``: 1 for a sync server, 0
for an async one) and keeps the same model of every table: float64 values, exact
(the values added are small multiples of 1/4, so float32 tables hold every sum
exactly, in any order of the adds). A step makes a table (array or matrix, sizes of
1, fewer values or rows than workers, many stripes; float32 or float64; the master's
``init_value`` in one of several forms, the others' ignored), or has every worker add
(each its own data, drawn from the step's seed and its worker id, so every worker
knows every worker's adds): whole tables or rows (``row_ids`` repeated, out of
order, empty), ``data`` as float32, float64, int arrays, lists or 2-D arrays,
``sync`` either way; then reads. A sync server's i-th ``get`` of a table on every
worker returns exactly the values after every worker's adds issued before it (the
docs' rule); an async server's reads come after a ``barrier()`` (every add seen by
every get) and before the next (no add meanwhile). Reads: whole tables, ``row_ids``
(repeats, any order, none), ``out=`` of the result's shape or flat. Each read is
compared with the model bit for bit; the first difference raises, naming the seed,
the step and the values (the exit status then says it all). Prints ``PASS model rank
<r> of <n>`` at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import synkhronos.multiverso as mv  # noqa: E402

#: Values or rows of a new table: 1, fewer than the workers, around stripe and page sizes.
SIZES = [1, 2, 3, 5, 64, 1000, 1023, 1024, 1025, 4096, 70_000]
ROWS = [1, 2, 3, 7, 64, 300]
COLS = [1, 2, 5, 64, 513]
#: Tables a run makes at most (each one lives to the end).
MAX_TABLES = 12


class Mismatch(AssertionError):
    pass


class Table:
    """One table and its model (float64, exact)."""

    def __init__(self, handler, model: np.ndarray, text: str):
        self.handler, self.model, self.text = handler, model, text
        self.matrix = isinstance(handler, mv.MatrixTableHandler)


def quarter_values(rng, shape) -> np.ndarray:
    """Small multiples of 1/4 (every partial sum of a run fits float32's 24 bits)."""
    return rng.integers(-8, 9, size=shape).astype(np.float64) / 4


def as_given(rng, values: np.ndarray, dtype, matrix: bool):
    """``values`` in one of the forms ``data`` may take (cast to the table's dtype, no loss)."""
    form = int(rng.integers(6))
    if form == 0:
        return values.astype(dtype)
    if form == 1:
        return values.astype(np.float64)
    if form == 2 and values.size < 5000:
        return values.reshape(-1).tolist()
    if form == 3 and np.all(values == np.round(values)):
        return values.astype(np.int32)
    if form == 4 and matrix:
        return np.ascontiguousarray(values.reshape(-1))  # flat for a 2-D table
    return values.astype(dtype)


class Model:
    def __init__(self, seed: int, sync: bool):
        self.seed, self.sync = seed, sync
        self.n, self.me = mv.workers_num(), mv.worker_id()
        self.tables: list[Table] = []
        self.log: list[str] = []

    def fail(self, what: str) -> None:
        tail = "\n  ".join(self.log[-12:])
        raise Mismatch(f"worker {self.me} of {self.n}, seed {self.seed}, sync={self.sync}: {what}\n"
                       f"  last steps:\n  {tail}")

    # -- steps ---------------------------------------------------------------

    def new_table(self, rng) -> None:
        dtype = np.float32 if rng.random() < 0.7 else np.float64
        matrix = rng.random() < 0.5
        shape = ((int(rng.choice(ROWS)), int(rng.choice(COLS))) if matrix else (int(rng.choice(SIZES)),))
        init = quarter_values(rng, shape) if rng.random() < 0.6 else None
        given = None
        if init is not None:  # (the master's init value wins; the others' are ignored)
            forms = as_given(rng, init, dtype, matrix), as_given(rng, init + 1, dtype, matrix)
            given = forms[self.me != 0]
        text = (f"MatrixTableHandler{shape}" if matrix else f"ArrayTableHandler({shape[0]})") + \
            f" {np.dtype(dtype).name}" + (" with init_value" if init is not None else "")
        self.log.append(f"table {len(self.tables)}: {text}")
        kw = {"init_value": given, "dtype": dtype}
        handler = mv.MatrixTableHandler(*shape, **kw) if matrix else mv.ArrayTableHandler(shape[0], **kw)
        model = np.zeros(shape) if init is None else init.copy()
        self.tables.append(Table(handler, model, text))

    def adds(self, rng) -> None:
        """Every worker adds to the same tables in the same order, each its own data."""
        picks = [int(rng.integers(len(self.tables))) for _ in range(int(rng.integers(1, 5)))]
        seeds = [int(s) for s in rng.integers(0, 2**31 - 1, size=len(picks))]
        for i, seed in zip(picks, seeds):
            t = self.tables[i]
            plan = np.random.default_rng(seed)  # (the same on every worker: what is added where)
            rows = None
            if t.matrix and plan.random() < 0.6:
                rows = plan.integers(0, t.model.shape[0], size=int(plan.integers(0, 2 * t.model.shape[0] + 2)))
            sync = bool(plan.random() < 0.3)
            shape = t.model.shape if rows is None else (len(rows), t.model.shape[1])
            for w in range(self.n):  # every worker's data, in the model; this one's also added
                data = quarter_values(np.random.default_rng([seed, w]), shape)
                if rows is None:
                    t.model += data
                else:
                    np.add.at(t.model, rows, data)
                if w == self.me:
                    given = as_given(np.random.default_rng([seed, w, 1]), data, t.handler.dtype, t.matrix)
                    self.log.append(f"add to table {i} ({t.text})" + ("" if rows is None else f", rows {rows.tolist()}")
                                    + f", sync={sync}, data {type(given).__name__}")
                    if rows is None:
                        t.handler.add(given, sync=sync)
                    else:
                        t.handler.add(given, row_ids=rows.tolist() if plan.random() < 0.3 else rows, sync=sync)

    def reads(self, rng) -> None:
        """Every worker reads the same tables (async: between two barriers, no add meanwhile)."""
        if not self.sync:
            mv.barrier()
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(len(self.tables)))
            t = self.tables[i]
            form = int(rng.integers(3))
            rows = None
            if t.matrix and rng.random() < 0.5:
                rows = rng.integers(0, t.model.shape[0], size=int(rng.integers(0, t.model.shape[0] + 3)))
            want = t.model if rows is None else t.model[rows]
            self.log.append(f"get table {i} ({t.text})" + ("" if rows is None else f", rows {rows.tolist()}")
                            + f", form {form}")
            out = None
            if form == 1:
                out = np.empty(want.shape if t.matrix else want.shape[0], dtype=t.handler.dtype)
            elif form == 2:
                out = np.empty(want.size, dtype=t.handler.dtype)  # (any C-contiguous array of as many values)
            args = {} if rows is None else {"row_ids": rows}
            got = t.handler.get(out=out, **args)
            if out is not None and got is not out:
                self.fail(f"get(out=...) of table {i} returned another array")
            got = np.asarray(got).reshape(want.shape)
            if got.dtype != t.handler.dtype:
                self.fail(f"get of table {i}: dtype {got.dtype}, the table's is {t.handler.dtype}")
            if not np.array_equal(got, want.astype(t.handler.dtype)):
                bad = np.argwhere(got != want.astype(t.handler.dtype))[:5].tolist()
                self.fail(f"get of table {i} ({t.text}) differs from the model at {bad}: "
                          f"got {[float(got[tuple(b)]) for b in bad]}, want {[float(want[tuple(b)]) for b in bad]}")
        if not self.sync:
            mv.barrier()

    def run(self, steps: int) -> None:
        rng = np.random.default_rng(self.seed)
        self.new_table(rng)
        for k in range(steps):
            u = rng.random()
            self.log.append(f"# step {k}")
            if u < 0.1 and len(self.tables) < MAX_TABLES:
                self.new_table(rng)
            elif u < 0.65:
                self.adds(rng)
            else:
                self.reads(rng)
        if not self.sync:
            mv.barrier()
        for i, t in enumerate(self.tables):  # the end: every table whole
            got = t.handler.get()
            if not np.array_equal(np.asarray(got).reshape(t.model.shape), t.model.astype(t.handler.dtype)):
                self.fail(f"table {i} ({t.text}) at the end differs from the model")


def main() -> None:
    seed, steps, sync, n = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
    mv.init(sync=sync, num_workers=n or None)
    Model(seed, sync).run(steps)
    print(f"PASS model rank {mv.worker_id()} of {mv.workers_num()}", flush=True)
    mv.shutdown()


if __name__ == "__main__":
    main()
