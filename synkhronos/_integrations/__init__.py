"""Integrations with PyTensor's backends and PyMC, under the public ``synkhronos.pymc`` and
``Function.as_op``: the distributed function as a PyTensor Op and its JAX and Numba
renderings (``graph_op``), PyTensor's JAX mode in the graph's dtypes (``jax_dtypes``), a
log-likelihood split by rows with the proof that the parts add up (``row_split``), and the
rewrites and the data layout that XLA runs faster on the CPU (``xla_rewrites``)."""
