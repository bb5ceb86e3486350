"""The exceptions that several layers raise, on the ground floor: this module imports nothing of
groupwise, so the registry, the config, the run folder and every component can all import it.

An exception raised and caught within one part of the library stays with it (``RewardError`` in
``rewards/_common.py``, ``CheckpointCorrupt`` in ``checkpoint.py``, ``RunLocked`` in ``runfolder.py``).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration names something that does not exist or is malformed."""
