"""Horovod's import path for its Keras module, `horovod.tensorflow.keras`: gradwire.keras, the same module."""

from gradwire.keras import *  # noqa: F403
from gradwire.keras import __all__, callbacks  # noqa: F401
