"""torus.integrations.keras: data-parallel Keras 3 training (TensorFlow backend) over torus collectives.

``LARS`` (optimizer), ``BatchSizeSchedule`` and ``LearningRateRule`` (batch-size control and the learning-rate
rule that follows it), ``BatchControl`` (the callback that applies both), ``TorusStrategy`` (a
``tf.distribute.Strategy``: ``with strategy.scope(): ...; model.fit(...)`` under ``mpiexec``).
"""
from torus.integrations.keras.lars import LARS

__all__ = ["LARS"]
