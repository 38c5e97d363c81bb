"""Multi-MNIST / Multi-Fashion overlays (Sabour et al. 2017, as in Hazimeh et al. 2021, Sec. 4.2).

Two images are drawn uniformly at random; one is shifted 4 pixels towards the top-left corner,
the other 4 pixels towards the bottom-right, on a 36×36 canvas (a 28×28 image centred on it
has a 4-pixel margin, so the offsets are 0 and 8), and the two are overlaid with a pixel-wise
maximum. Task 1: the top-left item's class; task 2: the bottom-right item's class.
"""

from __future__ import annotations

import torch

__all__ = ["make_overlays", "CANVAS"]

CANVAS = 36


def make_overlays(images: torch.Tensor, labels: torch.Tensor, n: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` overlaid examples from ``images`` uint8 ``[N, 28, 28]``, ``labels`` ``[N]``.

    Returns:
        x: float32 ``[n, 1, 36, 36]`` in [0, 1]; y: int64 ``[n, 2]`` (top-left, bottom-right).

    Raises:
        ValueError: on bad shapes, images that are not uint8, n < 1 or fewer than 2 images.
    """
    if images.dim() != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"images must be [N, 28, 28], got {tuple(images.shape)}.")
    if images.dtype != torch.uint8:
        raise ValueError(
            f"images must be uint8 pixel values 0..255 (as load_mnist returns them), got {images.dtype}; "
            f"for float images in [0, 1] pass (images * 255).round().to(torch.uint8)."
        )
    if labels.shape != images.shape[:1]:
        raise ValueError(f"labels must be [N] = [{images.shape[0]}], got {tuple(labels.shape)}.")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}.")
    if images.shape[0] < 2:
        raise ValueError("need at least 2 images to overlay.")
    i = torch.randint(0, images.shape[0], (n,), generator=generator)
    # a different image for the second item: shift by 1..N-1 (uniform over the others)
    j = (i + torch.randint(1, images.shape[0], (n,), generator=generator)) % images.shape[0]
    canvas = torch.zeros(n, 2, CANVAS, CANVAS, dtype=torch.uint8)
    canvas[:, 0, 0:28, 0:28] = images[i]
    canvas[:, 1, 8:36, 8:36] = images[j]
    x = canvas.max(dim=1, keepdim=True).values.float() / 255.0
    return x, torch.stack([labels[i], labels[j]], dim=1)
