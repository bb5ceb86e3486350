"""Policies: what the trainer samples from and trains, behind one protocol (``components.Policy``).

``model.policy`` names the kind (``policy/kinds.py``: ``build_policy``): ``lm`` (a Hugging Face causal
LM, ``policy/lm.py``, generating with our KV-cached engine, ``policy/engine.py``), ``flow`` (the 2-D
flow-matching toy, ``modalities/flow.py``), ``unified`` (think tokens from a tiny LM, then the flow toy
conditioned on them, ``modalities/unified.py``) or ``planner`` (latent actions, then the flow,
``modalities/planner.py``); the toys are built from ``model.params``.

This package's own module is empty on purpose: importing ``policy.forward`` (the packed forward that
providers and phases read) runs it, and it must not pull the policies in.
"""
