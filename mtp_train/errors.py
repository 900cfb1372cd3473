"""Errors a user can act on. Entry points print their message alone, without a traceback."""


class MtpError(Exception):
    """Base class: the message names the file, row or config key at fault."""


class ConfigError(MtpError):
    """A config value is invalid; the message starts with the full key."""


class DataError(MtpError):
    """An input file or dataset cannot be used."""


class BackboneError(MtpError):
    """A backbone cannot be located or loaded."""
