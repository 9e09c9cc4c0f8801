"""The Communicator interface every backend implements."""

from __future__ import annotations

import abc
from typing import Sequence

import numpy as np

__all__ = ["Communicator"]


class Communicator(abc.ABC):
    """Collectives over lists of arrays among all the processes of one fork.

    Every process calls the same method in the same order (SPMD). A process
    may contribute ``None`` to ``reduce``, ``all_reduce``, ``gather`` and
    ``all_gather`` when it has nothing to add (it computed on no rows); the
    reduction then runs over the processes that did contribute.
    ``weight`` scales a process's contribution to ``avg``.
    """

    rank: int
    size: int

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every process has entered the barrier."""

    @abc.abstractmethod
    def broadcast(self, arrays: Sequence[np.ndarray] | None, root: int) -> list[np.ndarray]:
        """Root's arrays, returned in every process."""

    @abc.abstractmethod
    def reduce(self, arrays, op: str, root: int, weight: float = 1.0):
        """Combine every process's arrays with ``op``; the result on root, None elsewhere."""

    @abc.abstractmethod
    def all_reduce(self, arrays, op: str, weight: float = 1.0):
        """Combine every process's arrays with ``op``; the result everywhere."""

    @abc.abstractmethod
    def gather(self, arrays, root: int):
        """On root, for each array, the list of every process's copy (None elsewhere)."""

    @abc.abstractmethod
    def all_gather(self, arrays):
        """Everywhere, for each array, the list of every process's copy."""

    def close(self) -> None:
        """Release what this process holds of the communicator."""
