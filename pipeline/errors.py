"""Errors that carry a user-facing message (file, line or field named)."""


class FucinaError(Exception):
    """Base class: the message alone is what the user sees."""


class UserError(FucinaError):
    """Bad input (file, flag, data): printed as one line, exit code 2."""


class CheckpointError(FucinaError):
    """A checkpoint or state file is missing, corrupt or does not match."""


class ConfigMismatchError(CheckpointError):
    """A structural config field in a checkpoint differs from the configured one."""


class DTypeMismatchError(CheckpointError):
    """A stored tensor's dtype differs from the configured one (never silently converted)."""


class GGUFError(UserError):
    """A GGUF file is malformed (truncated, inconsistent header, bad tensor table): names the file and field."""


class SafetensorsError(CheckpointError):
    """A safetensors file is malformed (header, dtype, shape or offsets): names the file and tensor."""
