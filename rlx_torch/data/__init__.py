"""Text shipped with the package for the demo (see README.txt here for source and licence)."""

from importlib import resources

__all__ = ["DEMO_CORPUS", "read_bytes"]

DEMO_CORPUS = "kjv_genesis.txt"


def read_bytes(name: str = DEMO_CORPUS) -> bytes:
    """The raw bytes of a text file shipped in ``rlx_torch/data``.

    Example::

        >>> read_bytes()[:16]
        b'THE FIRST BOOK O'
    """
    return resources.files(__package__).joinpath(name).read_bytes()
