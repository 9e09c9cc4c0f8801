"""The models PyMC users write, each a builder ``(rng, n) -> pm.Model``: synkhronos.pymc must give
PyMC's own log-density and gradient on every model of ``ZOO`` and refuse every model of
``REFUSED`` with a ``ValueError`` naming the variable (test_pymc_zoo.py).

Each builder draws its data and its sizes from ``rng``, so the tests run each shape on other data
and other parameters than the ones it was written with."""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytensor.tensor as pt

ZOO: dict = {}
REFUSED: dict = {}


def _zoo(fn):
    ZOO[fn.__name__] = fn
    return fn


def _refused(match):
    def wrap(fn):
        REFUSED[fn.__name__] = (fn, match)
        return fn
    return wrap


def _x(rng, n, k=None):
    return rng.standard_normal(n if k is None else (n, k))


# --- the shapes of the findings (each was wrong or crashed before) ---

@_zoo
def dims_on_the_observed(rng, n):
    with pm.Model(coords={"obs": np.arange(n)}) as m:
        s = pm.HalfNormal("s", 5)
        pm.Normal("y", 0, s, observed=rng.normal(0, 2, n), dims="obs")
    return m


@_zoo
def dims_on_data_and_observed(rng, n):
    with pm.Model(coords={"obs": np.arange(n), "feature": ["a", "b"]}) as m:
        X = pm.Data("X", _x(rng, n, 2), dims=("obs", "feature"))
        b = pm.Normal("b", 0, 1, dims="feature")
        s = pm.HalfNormal("s", 2)
        mu = pm.Deterministic("mu", X @ b, dims="obs")
        pm.Normal("y", mu, s, observed=rng.normal(0, 2, n), dims="obs")
    return m


@_zoo
def discrete_free_parent(rng, n):
    with pm.Model() as m:
        nn = pm.DiscreteUniform("n", 1, 10)
        k = pm.Poisson("k", nn)
        b = pm.Normal("b", 0, 1)
        pm.Poisson("y", pm.math.exp(b) * (k + 1), observed=rng.poisson(3.0, n))
    return m


@_zoo
def hierarchical_centred(rng, n):
    with pm.Model() as m:
        tau = pm.HalfNormal("tau", 1)
        a = pm.Normal("a", 0, tau)
        pm.Normal("y", a, 1, observed=rng.normal(0.5, 1, n))
    return m


@_zoo
def hierarchical_groups(rng, n):
    groups = int(rng.integers(3, 8))
    g = rng.integers(0, groups, n)
    with pm.Model(coords={"group": np.arange(groups)}) as m:
        gi = pm.Data("g", g)
        mu = pm.Normal("mu", 0, 2)
        sd = pm.HalfNormal("sd", 1)
        a = pm.Normal("a", mu, sd, dims="group")
        sigma = pm.HalfNormal("sigma", 1)
        pm.Normal("y", a[gi], sigma, observed=rng.normal(0, 1, n) + g * 0.3)
    return m


@_zoo
def hierarchical_non_centred(rng, n):
    groups = int(rng.integers(3, 8))
    g = rng.integers(0, groups, n)
    x = _x(rng, n)
    with pm.Model() as m:
        xd = pm.Data("x", x)
        gi = pm.Data("g", g)
        mu = pm.Normal("mu", 0, 2)
        sd = pm.HalfNormal("sd", 1)
        z = pm.Normal("z", 0, 1, shape=groups)
        a = pm.Deterministic("a", mu + sd * z)
        b = pm.Normal("b", 0, 1)
        pm.StudentT("y", nu=4, mu=a[gi] + b * xd, sigma=1.0, observed=x + rng.normal(0, 1, n))
    return m


@_zoo
def studentt_free_nu(rng, n):
    with pm.Model() as m:
        nu = pm.Gamma("nu", 2, 0.1)
        mu = pm.Normal("mu", 0, 1)
        sigma = pm.HalfNormal("sigma", 2)
        pm.StudentT("y", nu=nu, mu=mu, sigma=sigma, observed=rng.standard_t(3, n))
    return m


@_zoo
def observed_data_container(rng, n):
    with pm.Model() as m:
        yobs = pm.Data("yobs", rng.normal(1, 1, n))
        mu = pm.Normal("mu", 0, 1)
        pm.Normal("y", mu, 1, observed=yobs)
    return m


@_zoo
def integer_data_observed(rng, n):
    with pm.Model() as m:
        counts = pm.Data("counts", rng.poisson(2.0, n).astype("int64"))
        lam = pm.Gamma("lam", 2, 1)
        pm.Poisson("y", lam, observed=counts)
    return m


@_zoo
def bool_data_observed(rng, n):
    with pm.Model() as m:
        flags = pm.Data("flags", rng.random(n) < 0.3)
        p = pm.Beta("p", 1, 1)
        pm.Bernoulli("y", p, observed=flags)
    return m


@_zoo
def normal_mixture(rng, n):
    with pm.Model() as m:
        w = pm.Dirichlet("w", np.ones(2))
        mu = pm.Normal("mu", [-1, 1], 1, shape=2)
        sd = pm.HalfNormal("sd", 1, shape=2)
        pm.NormalMixture("y", w=w, mu=mu, sigma=sd,
                         observed=np.where(rng.random(n) < 0.4, rng.normal(-1, 0.5, n), rng.normal(1, 1, n)))
    return m


@_zoo
def mixture_of_dists(rng, n):
    with pm.Model() as m:
        w = pm.Dirichlet("w", np.ones(2))
        lam = pm.Gamma("lam", 2, 1, shape=2)
        comps = [pm.Poisson.dist(lam[0]), pm.Poisson.dist(lam[1])]
        pm.Mixture("y", w=w, comp_dists=comps, observed=rng.poisson(3, n))
    return m


@_zoo
def censored(rng, n):
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 2)
        sigma = pm.HalfNormal("sigma", 1)
        pm.Censored("y", pm.Normal.dist(mu, sigma), lower=-1.0, upper=1.5,
                    observed=np.clip(rng.normal(0.2, 1, n), -1.0, 1.5))
    return m


@_zoo
def initval_given(rng, n):
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, initval=0.5)
        pm.Normal("y", mu, 1, observed=rng.normal(0, 1, n))
    return m


@_zoo
def data_dims_with_none(rng, n):
    with pm.Model(coords={"obs": np.arange(n)}) as m:
        X = pm.Data("X", _x(rng, n, 2), dims=("obs", None))
        b = pm.Normal("b", 0, 1, shape=2)
        pm.Normal("y", X @ b, 1, observed=rng.normal(0, 1, n), dims="obs")
    return m


#: The shapes of the findings: on 1, 2 and 3 processes (the rest on 2).
FINDINGS = ("dims_on_the_observed", "discrete_free_parent", "hierarchical_centred", "hierarchical_groups",
            "studentt_free_nu", "observed_data_container", "integer_data_observed", "normal_mixture",
            "censored", "data_dims_with_none", "initval_given", "transposed_covariates", "table_column_by_group",
            "censored_by_hand", "masked_rows_through_products", "selected_in_numpy", "one_row_of_numbers")
#: In JAX mode (a fresh Python, JAX's compile per model): the shapes JAX mode got wrong or that
#: go through JAX's own rendering of PyMC's checks and broadcasts.
JAX_FINDINGS = ("dims_on_the_observed", "discrete_free_parent", "hierarchical_groups", "studentt_free_nu",
                "integer_data_observed", "censored")


# --- the shapes that already worked, kept working ---

@_zoo
def logistic_regression(rng, n):
    k = int(rng.integers(2, 5))
    X = _x(rng, n, k)
    with pm.Model() as m:
        Xd = pm.Data("X", X)
        b = pm.Normal("b", 0, 1, shape=k)
        pm.Bernoulli("y", logit_p=Xd @ b, observed=(rng.random(n) < 0.5).astype("int64"))
    return m


@_zoo
def poisson_glm_offset(rng, n):
    x = _x(rng, n)
    with pm.Model() as m:
        xd = pm.Data("x", x)
        off = pm.Data("log_exposure", rng.normal(0, 0.3, n))
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0, 1)
        pm.Poisson("y", pm.math.exp(a + b * xd + off), observed=rng.poisson(np.exp(0.3 + 0.5 * x)))
    return m


@_zoo
def negative_binomial_glm(rng, n):
    x = _x(rng, n)
    with pm.Model() as m:
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0, 1)
        alpha = pm.Exponential("alpha", 1)
        pm.NegativeBinomial("y", mu=pm.math.exp(a + b * x), alpha=alpha, observed=rng.poisson(2, n))
    return m


@_zoo
def two_observed_same_rows(rng, n):
    x = _x(rng, n)
    with pm.Model() as m:
        xd = pm.Data("x", x)
        a = pm.Normal("a", 0, 1)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y1", a * xd, s, observed=x + rng.normal(0, 1, n))
        pm.Poisson("y2", pm.math.exp(a), observed=rng.poisson(1, n))
    return m


@_zoo
def categorical_softmax(rng, n):
    k = 3
    X = _x(rng, n, 2)
    with pm.Model() as m:
        Xd = pm.Data("X", X)
        W = pm.Normal("W", 0, 1, shape=(2, k))
        pm.Categorical("y", p=pm.math.softmax(Xd @ W, axis=-1), observed=rng.integers(0, k, n))
    return m


@_zoo
def multinomial_rows(rng, n):
    with pm.Model() as m:
        p = pm.Dirichlet("p", np.ones(3))
        pm.Multinomial("y", n=5, p=p, observed=rng.multinomial(5, [0.2, 0.3, 0.5], size=n))
    return m


@_zoo
def mvnormal_rows(rng, n):
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=2)
        chol, _, _ = pm.LKJCholeskyCov("chol", n=2, eta=2, sd_dist=pm.HalfNormal.dist(1), compute_corr=True)
        pm.MvNormal("y", mu=mu, chol=chol, observed=rng.standard_normal((n, 2)))
    return m


@_zoo
def potential_and_deterministic(rng, n):
    x = _x(rng, n)
    with pm.Model() as m:
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0, 1)
        pm.Potential("tilt", -0.5 * (a - b) ** 2)
        mu = pm.Deterministic("mu", a + b * x)
        pm.Normal("y", mu, 1, observed=x + rng.normal(0, 1, n))
    return m


@_zoo
def truncated(rng, n):
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1)
        pm.Truncated("y", pm.Normal.dist(mu, 1), lower=0, observed=np.abs(rng.normal(0.5, 1, n)))
    return m


@_zoo
def float32_data(rng, n):
    x = _x(rng, n).astype("float32")
    with pm.Model() as m:
        xd = pm.Data("x", x)
        b = pm.Normal("b", 0, 1)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", b * xd, s, observed=(x + rng.normal(0, 1, n)).astype("float32"))
    return m


@_zoo
def robust_regression_shape_from_data(rng, n):
    x = _x(rng, n)
    with pm.Model() as m:
        xd = pm.Data("x", x)
        yd = pm.Data("yd", 2 * x + rng.standard_t(2, n))
        b = pm.Normal("b", 0, 1)
        s = pm.HalfNormal("s", 1)
        nu = pm.Exponential("nu", 0.1)
        pm.StudentT("y", nu=nu, mu=b * xd, sigma=s, observed=yd, shape=xd.shape[0])
    return m


@_zoo
def shape_given_as_int(rng, n):
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1)
        pm.Normal("y", mu, 1, observed=rng.normal(0, 1, n), shape=n)
    return m


# --- refused before, though per-row (a hunt's false refusals) ---

@_zoo
def transposed_covariates(rng, n):
    """A covariate matrix stored feature-major (rows along axis 1), ``dot(b, X)``."""
    k = int(rng.integers(2, 5))
    X = _x(rng, n, k)
    with pm.Model() as m:
        XT = pm.Data("XT", X.T.copy())
        b = pm.Normal("b", 0, 1, shape=k)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", pm.math.dot(b, XT), s, observed=X @ np.ones(k) + rng.normal(0, 1, n))
    return m


@_zoo
def table_column_by_group(rng, n):
    """``theta[:, g]``: a (K, G) table at a per-row group index, observed (K, rows) (rows along
    its last axis), and ``theta[0, g]``."""
    k, groups = int(rng.integers(2, 4)), int(rng.integers(3, 6))
    g = rng.integers(0, groups, n)
    with pm.Model() as m:
        gi = pm.Data("g", g)
        theta = pm.Normal("theta", 0, 1, shape=(k, groups))
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", theta[:, gi], s, observed=rng.normal(0, 1, (k, n)))
        pm.Poisson("c", pm.math.exp(theta[0, gi]), observed=rng.poisson(1.0, n))
    return m


@_zoo
def censored_by_hand(rng, n):
    """Censored survival data written by hand: the observed rows selected by a per-row boolean
    mask in the model (``t[~cens]``), the censored ones in a potential."""
    x = _x(rng, n)
    t = rng.exponential(np.exp(-0.5 * x))
    cens = rng.random(n) < 0.3
    with pm.Model() as m:
        xd, td, cd = pm.Data("x", x), pm.Data("t", t), pm.Data("cens", cens)
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0, 1)
        lam = pm.math.exp(a + b * xd)
        pm.Exponential("y", lam[~cd], observed=td[~cd])
        pm.Potential("censored", pm.math.sum(pm.logccdf(pm.Exponential.dist(lam[cd]), td[cd])))
    return m


@_zoo
def masked_rows_through_products(rng, n):
    """Rows kept by a per-row boolean mask read through a matrix product (``X[keep] @ b``) and
    a softmax taken at the kept rows' own positions (``Categorical``)."""
    X, keep = _x(rng, n, 3), rng.random(n) < 0.6
    with pm.Model() as m:
        Xd, kd = pm.Data("X", X), pm.Data("keep", keep)
        yd, cd = pm.Data("yd", X @ np.ones(3) + rng.normal(0, 1, n)), pm.Data("cd", rng.integers(0, 3, n))
        b = pm.Normal("b", 0, 1, shape=3)
        W = pm.Normal("W", 0, 1, shape=(3, 3))
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", Xd[kd] @ b, s, observed=yd[kd])
        pm.Categorical("c", p=pm.math.softmax(pm.math.dot(Xd[kd], W), axis=-1), observed=cd[kd])
    return m


@_zoo
def selected_in_numpy(rng, n):
    """The rows selected in NumPy for the observed data (``t[~cens]``) but in the model for the
    covariates (``lam[~cens]``): the mask taken as the positions it keeps (a warning says that
    each process computes the covariates of all the rows)."""
    x, cens = _x(rng, n), rng.random(n) < 0.3
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1)
        pm.Exponential("y", pm.math.exp(b * x)[~cens], observed=rng.exponential(1, n)[~cens])
    return m


@_zoo
def one_row_of_numbers(rng, n):
    """Observed data of one row given as numbers (PyTensor fixes the row axis at length 1, and
    ``sigma=1`` becomes a constant ``[1]``, not a row); one process holds the row."""
    X = _x(rng, 1, 3)
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=3)
        pm.Normal("y", X @ b, 1, observed=rng.standard_normal(1))
    return m


# --- refused, each with a ValueError naming the variable and the reason ---

@_refused("observed variable 'y' couples its rows")
def transposed_covariates_centred_over_rows(rng, n):
    """``dot(b, XT)`` centred by its mean over the rows. (A sum of ``XT`` over its rows alone is
    no coupling: ``XT`` is then data every process holds whole.)"""
    with pm.Model() as m:
        XT = pm.Data("XT", _x(rng, n, 3).T.copy())
        b = pm.Normal("b", 0, 1, shape=3)
        mu = pm.math.dot(b, XT)
        pm.Normal("y", mu - mu.mean(), 1, observed=rng.standard_normal(n))
    return m


@_refused("observed variable 'y' couples its rows: .*combines rows kept by different boolean masks")
def masks_that_differ(rng, n):
    cens = rng.random(n) < 0.3
    with pm.Model() as m:
        td, c1, c2 = pm.Data("t", rng.exponential(1, n)), pm.Data("c1", cens), pm.Data("c2", rng.permutation(cens))
        lam = pm.Gamma("lam", 2, 1)
        pm.Exponential("y", lam * pm.math.ones_like(td)[c1], observed=td[c2])
    return m


@_refused("observed variable 'y' couples its rows: .*indexes along the rows by an index that is neither "
          r"per-row data.*select them in NumPy: X\[idx\] @ b")
def covariates_at_another_rows_index(rng, n):
    """A bootstrap index in NumPy of as many rows as the data: ``(X @ b)[idx]`` reads rows at
    other rows' positions, which another process may hold."""
    X, idx = _x(rng, n, 3), rng.integers(0, n, n)
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1, shape=3)
        pm.Normal("y", (X @ b)[idx], 1, observed=(X @ np.ones(3) + rng.normal(0, 1, n))[idx])
    return m


@_refused(r"observed variable 'y': a process may hold none of its rows \(they are one row\), and PyTensor's "
          "batched op .* fails on none")
def one_row_of_numbers_multivariate(rng, n):
    """One row of numbers of a multivariate distribution: the processes that hold no row would
    run its batched op on none, which PyTensor's Python implementation cannot."""
    with pm.Model() as m:
        mu = pm.Normal("mu", 0, 1, shape=2)
        pm.MvNormal("y", mu, cov=np.eye(2), observed=rng.standard_normal((1, 2)))
    return m


@_refused("free variable 'u' has one entry per row.*marginalise")
def observation_level_effects(rng, n):
    with pm.Model() as m:
        a = pm.Normal("a", 0, 1)
        u = pm.Normal("u", 0, 1, shape=n)
        pm.Normal("y", a + u, 1, observed=rng.standard_normal(n))
    return m


@_refused("observed variable 'y' couples its rows")
def row_mean_in_the_likelihood(rng, n):
    with pm.Model() as m:
        x = pm.Data("x", _x(rng, n))
        b = pm.Normal("b", 0, 1)
        pm.Normal("y", b * (x - x.mean()), 1, observed=rng.standard_normal(n))
    return m


@_refused("observed variable 'y' couples its rows: its value depends on the number of rows, or on their positions")
def trend_over_row_positions_gated_by_data(rng, n):
    """Row positions (``pt.arange`` over the rows) as a value: each share would count from 0.
    Hidden from a numeric check by a gate that is 0 when the model is built."""
    with pm.Model() as m:
        yd = pm.Data("yd", 0.01 * np.arange(n) + rng.standard_normal(n))
        use_trend = pm.Data("use_trend", 0.0)
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0.01, 0.01)
        pm.Normal("y", a + use_trend * b * pt.arange(yd.shape[0]), 1, observed=yd)
    return m


@_refused("observed variable 'y' couples its rows: its value depends on the number of rows, or on their positions")
def trend_over_row_positions_gated_by_a_discrete(rng, n):
    """The same gated by a discrete free variable whose initial point is 0."""
    with pm.Model() as m:
        yd = pm.Data("yd", 0.01 * np.arange(n) + rng.standard_normal(n))
        on = pm.Bernoulli("on", 0.1)
        a = pm.Normal("a", 0, 1)
        b = pm.Normal("b", 0.01, 0.01)
        pm.Normal("y", a + on * b * pt.arange(yd.shape[0]).astype("float64"), 1, observed=yd)
    return m


@_refused("observed variable 'y' couples its rows")
def row_mean_hidden_by_zeros(rng, n):
    """The coupling does not show on the data the model was built with (all zeros)."""
    with pm.Model() as m:
        xd = pm.Data("x", np.zeros(n))
        yd = pm.Data("yd", np.zeros(n))
        b = pm.Normal("b", 0, 1)
        s = pm.HalfNormal("s", 1)
        pm.Normal("y", b * (xd - xd.mean()), s, observed=yd, shape=xd.shape[0])
    return m


@_refused("observed variable 'w' couples its rows")
def random_walk(rng, n):
    with pm.Model() as m:
        pm.GaussianRandomWalk("w", sigma=1.0, observed=rng.standard_normal(n).cumsum(),
                              init_dist=pm.Normal.dist(0, 1))
    return m


@_refused("free variable 'z' has one entry per row")
def per_row_latent(rng, n):
    with pm.Model() as m:
        z = pm.Normal("z", 0, 1, shape=n)
        pm.Normal("y", z, 1, observed=rng.standard_normal(n))
    return m


@_refused("nothing continuous")
def only_discrete_free(rng, n):
    with pm.Model() as m:
        k = pm.Poisson("k", 3)
        pm.Poisson("y", k + 1, observed=rng.poisson(3, n))
    return m


@_refused("missing values")
def missing_values(rng, n):
    x = _x(rng, n)
    y = x + rng.normal(0, 1, n)
    y[::7] = np.nan
    with pm.Model() as m:
        b = pm.Normal("b", 0, 1)
        pm.Normal("y", b * x, 1, observed=y)
    return m
