"""Batch-size control and the learning-rate rule that follows it: pure functions of the epoch number.

Everything here is derived from the epoch (and the position inside it), never from state carried between
batches, so a run resumed at epoch ``e`` gets the same global batch and learning rate as one that never stopped.
TensorFlow is not needed.
"""
from __future__ import annotations

import bisect

_DECAYS = ("poly", "step", "none")


class BatchSizeSchedule:
    """Global batch size by epoch: ``{0: 256, 5: 512}`` means 256 for epochs 0-4, 512 from epoch 5 on.

    ``schedule`` is a dict ``{first_epoch: global_batch}`` or the string form ``"0:256,5:512"``. Epochs are
    0-based, as in ``keras.Model.fit``. Raises ``ValueError`` when epoch 0 is missing, an epoch is negative or
    a batch size is not a positive integer.

    Choosing one (docs/keras.md, "Choosing a large batch", from bench/large_batch/): start at a quarter of the
    target batch and double it at a third and at two thirds of the epochs, with :class:`LearningRateRule` so
    that the rate follows the batch (Mikami et al. 2018, arXiv:1811.05233, section 3.1). It needs steps, not
    only epochs: where an epoch at the target is only a few steps, give the run more epochs.
    """

    def __init__(self, schedule: dict[int, int] | str):
        if isinstance(schedule, str):
            try:
                pairs = [item.split(":") for item in schedule.replace(" ", "").split(",") if item]
                schedule = {int(e): int(b) for e, b in pairs}
            except ValueError as exc:
                raise ValueError(f"BatchSizeSchedule: cannot parse {schedule!r}; expected 'epoch:batch,...' "
                                 "such as '0:256,5:512'") from exc
        items = sorted((int(e), int(b)) for e, b in schedule.items())
        if not items or items[0][0] != 0:
            raise ValueError(f"BatchSizeSchedule: needs an entry for epoch 0, got {dict(items)}")
        bad = [(e, b) for e, b in items if e < 0 or b < 1]
        if bad:
            raise ValueError(f"BatchSizeSchedule: epochs must be >= 0 and batch sizes >= 1, got {bad}")
        self._epochs = [e for e, _ in items]
        self._batches = [b for _, b in items]

    def global_batch(self, epoch: int) -> int:
        """Global batch size (samples per step, summed over ranks) in ``epoch``."""
        if epoch < 0:
            raise ValueError(f"BatchSizeSchedule.global_batch: epoch {epoch} < 0")
        return self._batches[bisect.bisect_right(self._epochs, epoch) - 1]

    def per_rank_batch(self, epoch: int, size: int) -> int:
        """Samples per step on each of ``size`` ranks; ``ValueError`` unless ``size`` divides the global batch."""
        batch = self.global_batch(epoch)
        if size < 1 or batch % size:
            raise ValueError(f"BatchSizeSchedule.per_rank_batch: global batch {batch} at epoch {epoch} does "
                             f"not divide into {size} ranks")
        return batch // size

    def steps_per_epoch(self, epoch: int, num_examples: int) -> int:
        """``floor(num_examples / global_batch(epoch))``: the remainder is dropped, so every rank runs the same
        number of steps. Raises ``ValueError`` when that is 0."""
        batch = self.global_batch(epoch)
        steps = num_examples // batch
        if steps < 1:
            raise ValueError(f"BatchSizeSchedule.steps_per_epoch: {num_examples} examples make no full global "
                             f"batch of {batch} at epoch {epoch}")
        return steps

    def segments(self, epochs: int, initial_epoch: int = 0) -> list[tuple[int, int, int]]:
        """``[(start, stop, global_batch), ...]`` covering ``[initial_epoch, epochs)``: runs of epochs with one
        batch size, e.g. one ``model.fit(..., initial_epoch=start, epochs=stop)`` call each."""
        cuts = sorted({initial_epoch, epochs, *(e for e in self._epochs if initial_epoch < e < epochs)})
        return [(a, b, self.global_batch(a)) for a, b in zip(cuts, cuts[1:])]

    def get_config(self) -> dict:
        return {"schedule": ",".join(f"{e}:{b}" for e, b in zip(self._epochs, self._batches))}

    @classmethod
    def from_config(cls, config: dict) -> BatchSizeSchedule:
        return cls(config["schedule"])

    def __repr__(self) -> str:
        return f"BatchSizeSchedule({self.get_config()['schedule']!r})"


class LearningRateRule:
    """Learning rate as a function of the (fractional) epoch and the current global batch.

    With ``peak = base_lr * global_batch / base_batch`` (linear scaling rule, Goyal et al. 2017,
    arXiv:1706.02677, section 2.1) and ``e`` the epoch as a float (``epoch + batch / steps_per_epoch``):

    - warm-up, ``e < warmup_epochs``: ``lr = peak * e / warmup_epochs`` (linear from 0; Goyal et al. section 2.2
      "gradual warmup", which starts from ``base_lr`` instead; here the first step of a run has lr 0).
    - ``decay="poly"``: ``lr = min_lr + (peak - min_lr) * (1 - (e - w) / (total_epochs - w)) ** power`` for
      ``w = warmup_epochs <= e <= total_epochs`` and ``min_lr`` after (You, Gitman, Ginsburg 2017,
      arXiv:1708.03888, section 5 and Mikami et al. 2018, arXiv:1811.05233, section 3.1 use power 2).
    - ``decay="step"``: ``lr = max(min_lr, peak * step_factor ** k)`` with ``k`` the number of ``step_epochs``
      that are ``<= e`` (Goyal et al.: ``step_epochs=(30, 60, 80)``, ``step_factor=0.1``).
    - ``decay="none"``: ``lr = peak`` after warm-up.

    Since ``peak`` follows the global batch, a batch-size schedule that doubles the batch doubles the rate.
    Raises ``ValueError`` for an unknown decay, ``total_epochs <= warmup_epochs`` with poly decay, or
    negative arguments.
    """

    def __init__(self, base_lr: float, base_batch: int = 256, warmup_epochs: float = 0.0, decay: str = "poly",
                 total_epochs: float | None = None, power: float = 2.0, step_epochs=(), step_factor: float = 0.1,
                 min_lr: float = 0.0):
        if decay not in _DECAYS:
            raise ValueError(f"LearningRateRule: decay {decay!r} not one of {_DECAYS}")
        if base_lr < 0 or base_batch < 1 or warmup_epochs < 0 or min_lr < 0:
            raise ValueError("LearningRateRule: base_lr, warmup_epochs, min_lr must be >= 0 and base_batch >= 1")
        if decay == "poly" and (total_epochs is None or total_epochs <= warmup_epochs):
            raise ValueError(f"LearningRateRule: poly decay needs total_epochs > warmup_epochs "
                             f"({warmup_epochs}), got {total_epochs}")
        self.base_lr, self.base_batch = float(base_lr), int(base_batch)
        self.warmup_epochs, self.decay = float(warmup_epochs), decay
        self.total_epochs = None if total_epochs is None else float(total_epochs)
        self.power, self.step_factor, self.min_lr = float(power), float(step_factor), float(min_lr)
        self.step_epochs = tuple(sorted(float(e) for e in step_epochs))

    def peak(self, global_batch: int) -> float:
        """``base_lr * global_batch / base_batch``."""
        return self.base_lr * global_batch / self.base_batch

    def lr(self, epoch: float, global_batch: int) -> float:
        """Learning rate at fractional epoch ``epoch`` (>= 0) for ``global_batch`` samples per step."""
        peak = self.peak(global_batch)
        if epoch < self.warmup_epochs:
            return peak * epoch / self.warmup_epochs
        if self.decay == "poly" and self.total_epochs is not None:  # always set for poly (__init__ checks)
            left = max(0.0, 1.0 - (epoch - self.warmup_epochs) / (self.total_epochs - self.warmup_epochs))
            return self.min_lr + (peak - self.min_lr) * left ** self.power
        if self.decay == "step":
            return max(self.min_lr, peak * self.step_factor ** bisect.bisect_right(self.step_epochs, epoch))
        return peak

    def get_config(self) -> dict:
        return {"base_lr": self.base_lr, "base_batch": self.base_batch, "warmup_epochs": self.warmup_epochs,
                "decay": self.decay, "total_epochs": self.total_epochs, "power": self.power,
                "step_epochs": list(self.step_epochs), "step_factor": self.step_factor, "min_lr": self.min_lr}

    @classmethod
    def from_config(cls, config: dict) -> LearningRateRule:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"LearningRateRule({args})"

