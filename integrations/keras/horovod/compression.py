"""Horovod's ``Compression`` namespace mapped onto torus' wire formats.

Horovod casts floating tensors to 16 bits before its all-reduce and sums in 16 bits. Here the class only names
the wire format of ``torus.integrations.keras.collectives.host.HostAllreduce``: float32 buffers travel as float16
(``fp16``) or bfloat16 (``bf16``, a torus extension), every reduction step accumulates in float32 and rounds
once; other dtypes (float64, float16, integers) travel as they are. ``compress``/``decompress`` keep Horovod's
interface (a cast and the context to undo it) for code that calls them directly; user-defined compressors
(subclasses without a torus ``wire``) are refused by ``wire_format``.
"""
from __future__ import annotations

import tensorflow as tf


class Compressor:
    """A named wire format; ``compress(t) -> (t', ctx)`` and ``decompress(t', ctx) -> t`` as in Horovod."""
    wire = ""
    dtype = None  # the 16-bit type floating tensors are cast to, or None for no cast

    @classmethod
    def compress(cls, tensor):
        if cls.dtype is None or not tensor.dtype.is_floating:
            return tensor, None
        return tf.cast(tensor, cls.dtype), tensor.dtype

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class NoneCompressor(Compressor):
    """No compression (the default)."""
    wire = "none"


class FP16Compressor(Compressor):
    """float32 gradients travel as float16."""
    wire, dtype = "fp16", tf.float16


class BF16Compressor(Compressor):
    """float32 gradients travel as bfloat16 (not in Horovod)."""
    wire, dtype = "bf16", tf.bfloat16


class Compression:
    """``Compression.none`` (default), ``Compression.fp16``; ``Compression.bf16`` is a torus extension."""
    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def wire_format(compression, what: str, rank: int) -> str:
    """The ``HostAllreduce`` compression name for one of the ``Compression`` classes; ``ValueError`` otherwise."""
    if isinstance(compression, type) and issubclass(compression, Compressor) and compression.wire:
        return compression.wire
    raise ValueError(f"{what} on rank {rank}: compression must be hvd.Compression.none, .fp16 or .bf16, got "
                     f"{compression!r} (custom Compressor classes are not supported)")
