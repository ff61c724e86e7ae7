"""He et al. 2016's CIFAR ResNets (arXiv:1512.03385, section 4.2) in Keras 3: ``torus-train --model resnet20``."""
from __future__ import annotations

import keras


@keras.saving.register_keras_serializable("torus")
class ZeroPadShortcut(keras.layers.Layer):
    """The shortcut where a stage halves the map and widens it (He et al. 2016, section 4.2, option A): every
    second pixel, ``extra`` zero channels appended; ``(B, H, W, C)`` to ``(B, ceil(H/2), ceil(W/2), C + extra)``,
    no weights."""

    def __init__(self, extra: int, **kwargs):
        super().__init__(**kwargs)
        self.extra = int(extra)

    def call(self, x):
        return keras.ops.pad(x[:, ::2, ::2, :], [[0, 0], [0, 0], [0, 0], [0, self.extra]])

    def compute_output_shape(self, input_shape):
        b, h, w, c = input_shape
        return (b, *(None if n is None else (n + 1) // 2 for n in (h, w)), c + self.extra)

    def get_config(self):
        return {**super().get_config(), "extra": self.extra}


def resnet20(input_shape: tuple, num_classes: int, blocks: int = 3):
    """He et al. 2016's CIFAR ResNet (arXiv:1512.03385, section 4.2) with ``6 * blocks + 2`` layers (ResNet-20
    for ``blocks=3``), for float32 images ``input_shape = (H, W, C)``, returning logits ``(batch, num_classes)``.

    A 3x3 convolution with 16 filters, then three stages of ``blocks`` basic blocks (two 3x3 convolutions,
    each followed by batch normalization, ReLU after the first and after the sum) with 16, 32 and 64 filters;
    the first convolution of stages 2 and 3 has stride 2. Shortcuts are identities, and where a stage halves
    the map and doubles the filters the shortcut takes every second pixel and pads the new channels with zeros
    (the paper's option A, no parameters). Then global average pooling and a dense layer. Convolutions have no
    bias (batch normalization follows) and He-normal weights (the paper's reference [13]). Trainable weights:
    ``9*16*C + 9*16*16*2*blocks + 9*16*32 + 9*32*32*(2*blocks - 1) + 9*32*64 + 9*64*64*(2*blocks - 1)``
    in the convolutions, ``2 * (16 + 2*blocks*(16 + 32 + 64))`` in batch normalization and ``65 * num_classes``
    in the dense layer; batch normalization adds as many moving statistics, not trained. For 28x28 images the
    stages see 28, 14 and 7 pixels a side instead of the paper's 32, 16 and 8.
    """
    def conv(x, filters, strides=1):
        x = keras.layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False,
                                kernel_initializer="he_normal")(x)
        return keras.layers.BatchNormalization()(x)

    inputs = keras.Input(input_shape)
    x = keras.layers.ReLU()(conv(inputs, 16))
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(blocks):
            strides = 2 if stage > 0 and block == 0 else 1
            y = conv(keras.layers.ReLU()(conv(x, filters, strides)), filters)
            shortcut = x if strides == 1 else ZeroPadShortcut(filters - x.shape[-1])(x)
            x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x), name=f"resnet{6 * blocks + 2}")
