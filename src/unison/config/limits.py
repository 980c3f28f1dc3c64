"""Limits that the configuration states and lower layers apply too (imports nothing).

``MIN_IMAGE_SIZE``/``MAX_IMAGE_SIZE``: the range of ``--image-size``; the data layer refuses a default view size
(the data's shorter side) below the same minimum. ``KNN_REFERENCE``: the default of ``--knn-reference``, which
the data layer's kNN sets use when no configuration gives one.
"""

MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 8, 8192   # crops below 8 px leave nothing to augment; 8192**2 * 3 bytes a view
KNN_REFERENCE = 5_000   # default training images in the kNN reference set: bounds each kNN's time and memory
MAX_LOCAL_CROPS = 16   # multi-crop: DINO and SwAV use 6 to 10; each local crop is one more backbone pass per image
