"""Horovod's `SyncBatchNormalization` for TensorFlow: a Keras `BatchNormalization` whose training-time moments are
taken over every worker's batch, not this worker's alone (the statistics of the whole global batch, as one process
training on it would see them; the moving averages then agree on every worker).

    x = gw.SyncBatchNormalization(axis=-1)(x, training=True)

Each worker's mean and mean of squares travel together in one averaged allreduce per call (every worker contributes
equally: equal batch sizes, as Horovod assumes); the variance is the averaged mean of squares less the squared mean.
Gradients flow through the allreduce (collectives.py), so backward sees the synchronised statistics too.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from gradwire.session import current_worker

from .collectives import Average, allreduce


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """BatchNormalization with its batch statistics averaged over the workers while training. `fused` is Horovod's
    argument: only False (the default) is accepted, as Horovod's layer accepts it."""

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused or fused is None:
            raise ValueError("SyncBatchNormalization does not support fused=True")
        super().__init__(**kwargs)  # named sync_batch_normalization, _1, ... alike on every worker running one program

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        mean, variance = super()._moments(inputs, mask)
        if current_worker().size == 1:
            return mean, variance
        both = tf.stack([mean, variance + tf.math.square(mean)])
        both = allreduce(both, op=Average, name=f"gw.SyncBatchNormalization.{self.name}")
        mean, mean_of_squares = tf.unstack(both)
        return mean, mean_of_squares - tf.math.square(mean)
