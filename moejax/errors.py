"""The project's own exception types, apart so that any module can raise them without importing more."""


class ConfigError(ValueError):
  """A config that cannot describe a working model or run."""
