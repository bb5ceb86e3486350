"""Policies: what the trainer samples from and trains, behind one protocol (``components.Policy``).

``model.policy`` names the kind (``policy/kinds.py``: ``build_policy``): ``lm`` (a Hugging Face causal
LM, ``policy/lm.py``, generating with our KV-cached engine, ``policy/engine.py``), ``flow`` (the 2-D
flow-matching toy, ``modalities/flow.py``), ``planner`` (a planner's actions, Gaussian latents or think tokens
from a tiny LM, then the flow conditioned on them, ``modalities/planner.py``) or ``unified`` (the think-LM
planner under its old names, ``modalities/unified.py``); the toys are built from ``model.params``.

This package's own module is empty on purpose: importing ``policy.forward`` (the packed forward that
providers and phases read) runs it, and it must not pull the policies in.
"""
