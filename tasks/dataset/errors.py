"""The prepare stage's one exception family: every message names the file, key or setting to change."""


class PrepareError(RuntimeError):
    """The dataset cannot be prepared as configured; nothing was published."""


class SourceError(PrepareError):
    """The dataset setting names nothing usable: missing files, unsupported or mixed formats, bad contents."""
