"""Device detection and the device-specific runtime: the only package that knows the hardware."""

from executor.platform.platform import Platform, create_platform, detect_device_type, resolve_dtype

__all__ = ["Platform", "create_platform", "detect_device_type", "resolve_dtype"]
