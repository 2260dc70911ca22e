from .functional import InterpolationMode  # noqa: F401
