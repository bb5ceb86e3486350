"""Seeded comparisons and paper claims: ``groupwise compare`` and ``groupwise claims``.

- ``intervals``: Student-t 95 % intervals, paired effects, verdicts (plain Python).
- ``compare``: runs configs × seeds through the trainer in subprocesses (resumable) and reports.
- ``claimfile``: the ``<NN-slug>.toml`` claim format (``papers/NN_slug/claims/``), finding and validating files.
- ``report``: runs claims, judges them, regenerates ``docs/claims.md`` (readings preserved).
- ``plot``: ``curves.png``.
"""
