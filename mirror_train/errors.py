"""The one exception type users see.

Everything a user can get wrong (a path, a checksum, an out-of-range κ, a malformed data line) raises
`MirrorTrainError` with a message that names the thing; the CLI prints that message alone, without a traceback.
"""


class MirrorTrainError(Exception):
    """A user-facing error: the message says what was wrong and where."""
