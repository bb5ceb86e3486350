"""Running untrusted, model-written code: a bubblewrap sandbox with rlimits and seccomp
(``bwrap.py``) and the small harness that runs one test case inside it (``harness.py``).
Used by the ``code`` reward; see docs/sandbox.md for the threat model."""
