"""Data-parallel training helpers: split update rules and a ready-made train step.

:mod:`synkhronos.extensions.updates` holds first-order update rules (SGD,
momentum, Adam, ...) split in two around one all-reduce of a single
flattened gradient vector; :mod:`synkhronos.extensions.train` builds a
callable train step from a loss, its parameters and one of those rules.
"""

from . import train, updates
from .train import TrainStep, make_train_function
from .updates import (RULES, SplitUpdates, adadelta, adagrad, adam, adamax, momentum,
                      nesterov_momentum, plain_updates, rmsprop, sgd)

__all__ = [
    "updates", "train", "make_train_function", "TrainStep", "SplitUpdates", "plain_updates",
    "RULES", "sgd", "momentum", "nesterov_momentum", "adagrad", "rmsprop", "adadelta",
    "adam", "adamax",
]
