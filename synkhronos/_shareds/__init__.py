"""Collectives on shared variables: the public functions, the command with its
inline and host paths, and the values' shared-memory homes."""
