"""Stage "callbacks" of ``fit_hook``: rank 0's state reaches every rank before the first update.

``add_initial_state`` appends an ``InitialState`` callback to the call's callbacks (after the user's, so a
callback that restores weights in ``on_train_begin`` runs first; before the History and progress bar Keras
adds). At ``on_train_begin`` it builds the optimizer if needed (its slots, iteration count and loss scale must
exist to be copied) and broadcasts rank 0's model variables and optimizer variables; at the start of a
standalone ``evaluate`` / ``predict`` it broadcasts the model variables, so every rank evaluates rank 0's
model. Broadcasting after the first batch, as Horovod's callback does, would apply step 1 to weights that
differ between ranks. The validation ``evaluate`` inside ``fit`` reuses fit's callback list, which holds the
callback already: nothing is added or broadcast again, and ``strategy.callbacks()`` adds nothing (it is ``[]``).

Random layers (Dropout, GaussianNoise, random augmentation): their ``SeedGenerator`` states are model
variables, so the broadcast would give every rank rank 0's stream, and each rank would draw the same mask
for its share of the batch (rows ``i`` of every rank dropped alike). After each broadcast every rank
offsets the first word of each state by ``rank * SEED_SPREAD`` (rank 0 keeps its own): independent draws per
rank, still a function of rank 0's state, so a resumed run (rank 0's checkpoint, broadcast, offset) draws
what the uninterrupted one would (Keras advances a state by adding ``[0, 1]``, which commutes with the
offset). One process' masks are not reproduced: N ranks draw N streams for a batch one process draws from one.
"""
from __future__ import annotations

import keras
import numpy as np

from torus.integrations.keras.fit import fit_hook

SEED_SPREAD = 0x9E3779B9  # 2^32 / golden ratio: rank offsets far apart from any seed Keras draws nearby


class InitialState(keras.callbacks.Callback):
    """Broadcasts rank 0's model (and, in ``fit``, optimizer) variables at the start of the call; see the
    module docstring. Collective: every rank's call must hold it."""

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy
        self._fitting = False

    def on_train_begin(self, logs=None):
        self._fitting = True
        model, optimizer = self.model, self.model.optimizer
        if not optimizer.built:
            with self.strategy.scope():
                optimizer.build(model.trainable_variables)
        self._broadcast(list(model.variables) + list(optimizer.variables))

    def on_train_end(self, logs=None):
        self._fitting = False

    def on_test_begin(self, logs=None):
        if not self._fitting:
            self._broadcast(self.model.variables)

    def on_predict_begin(self, logs=None):
        self._broadcast(self.model.variables)

    def _broadcast(self, variables) -> None:
        self.strategy.broadcast_variables(variables)
        rank = self.strategy.rank
        if not rank:
            return
        for v in self.model.variables:
            if v.path.endswith("seed_generator_state"):  # keras.random.SeedGenerator's variable
                state = np.array(v.numpy())
                state[0] += rank * SEED_SPREAD
                v.assign(state)


def add_initial_state(call) -> None:
    """Stage "callbacks": append an ``InitialState`` unless the call's callbacks hold one already."""
    fit_hook.add_callback(call, InitialState, call.strategy)
