"""Errors raised by the cache package."""


class QuantizerConfigError(ValueError):
    """An invalid configuration value: the message names the field, the value and what is allowed."""

    def __init__(self, field: str, value, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is invalid: expected {allowed}")


class CacheInputError(ValueError):
    """Keys/values handed to a cache have the wrong shape, dtype or contents."""


class SavedCacheError(ValueError):
    """A saved cache file cannot be written or read back (missing, corrupt, unknown version, wrong method or
    model); the message names the file and the problem."""
