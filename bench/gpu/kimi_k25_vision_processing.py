"""The image processor of the generated Kimi K2.5 model (make_model.py --shape kimi-k2.5-Nl), loaded by
transformers' AutoImageProcessor as remote code from the model directory.

It keeps the contract vLLM 0.21.0's Kimi-K2.5 model reads from Moonshot's processor: `num_frames_per_chunk`,
`media_tokens_calculator(chunk)` and `preprocess(chunks)` giving `pixel_values` (patches x 3 x patch x
patch) and `grid_thws` (frames, rows, columns of patches per chunk, rows and columns multiples of the merge
kernel). Images are scaled down to the patch limits and cut into whole merge blocks; video decoding is left out.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature


class KimiK25VisionProcessor(BaseImageProcessor):
    model_type = "kimi_k25"
    model_input_names = ("pixel_values", "grid_thws")

    def __init__(self, media_proc_cfg: dict | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})
        self.num_frames_per_chunk = self.media_proc_cfg["temporal_merge_kernel_size"]

    @staticmethod
    def _frames(media: dict) -> list:
        return [media["image"]] if media["type"] == "image" else list(media["video_chunk"])

    def _grid(self, width: int, height: int) -> tuple[int, int]:
        """Rows and columns of patches the frame is resized to."""
        cfg = self.media_proc_cfg
        patch, merge, side = cfg["patch_size"], cfg["merge_kernel_size"], cfg["patch_limit_on_one_side"]
        scale = min(1.0, math.sqrt(cfg["in_patch_limit"] / (width * height)) * patch,
                    side * patch / width, side * patch / height)
        block = patch * merge
        return (max(1, int(height * scale) // block) * merge, max(1, int(width * scale) // block) * merge)

    def media_tokens_calculator(self, media: dict) -> int:
        rows, columns = self._grid(*self._frames(media)[0].size)
        return rows * columns // self.media_proc_cfg["merge_kernel_size"] ** 2

    def preprocess(self, medias: Any, return_tensors: Any = None, **kwargs: Any) -> BatchFeature:
        medias = medias if isinstance(medias, list) else [medias]
        if not medias:
            return BatchFeature(data={}, tensor_type=return_tensors)
        cfg = self.media_proc_cfg
        patch = cfg["patch_size"]
        mean, std = np.array(cfg["image_mean"], np.float32), np.array(cfg["image_std"], np.float32)
        patches, grids = [], []
        for media in medias:
            frames = self._frames(media)
            rows, columns = self._grid(*frames[0].size)
            size = (columns * patch, rows * patch)
            pixels = np.stack([np.asarray(f.convert("RGB").resize(size), np.float32) / 255 for f in frames])
            pixels = (pixels - mean) / std
            count = len(frames)
            grid = pixels.reshape(count, rows, patch, columns, patch, 3).transpose(0, 1, 3, 5, 2, 4)
            patches.append(grid.reshape(-1, 3, patch, patch))
            grids.append([count, rows, columns])
        data = {"pixel_values": np.concatenate(patches), "grid_thws": np.array(grids, np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)
