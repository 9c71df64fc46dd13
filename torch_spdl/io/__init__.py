"""Media helpers for a dataset's ``preprocess`` hook: decode, resize, collate.

They run on the loader's CPU worker threads and spend their time in native code that releases the
GIL (libjpeg-turbo, libpng and libwebp through torchvision, FFmpeg through PyAV, torch's kernels),
so ``num_workers`` threads decode in parallel.
"""

from .batch import collate_images
from .crop import RandomResizedCrop, random_crop_box, resized_crop
from .device_decode import EncodedBatch, EncodedImage
from .image import decode_image
from .resize import output_size, resize
from .video import decode_video

__all__ = [
    "EncodedBatch",
    "EncodedImage",
    "RandomResizedCrop",
    "collate_images",
    "decode_image",
    "decode_video",
    "output_size",
    "random_crop_box",
    "resize",
    "resized_crop",
]
