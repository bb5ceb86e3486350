"""Need providers: how the trainer computes each ``Need.quantity`` (registry stage ``provider``).

A provider says which quantities the packed forward must compute, for which ``(model, view)``
pairs (``plan``), and turns those forward results into the need's value (``finish``). The trainer's
:class:`groupwise.needs.NeedResolver` merges the plans of every need, so quantities of one
``(model, view)`` come from one forward pass, and runs each pass once per step.

Protocol (structural)::

    grad_ok: bool                                   # may be computed with autograd in a micro-batch
    check(need) -> None                             # build-time: a malformed argument is a ConfigError
    plan(need) -> dict[(model, view), set[str]]     # forward quantities it reads
    finish(need, results, model) -> Tensor          # [B,G,T,...] float32 from results[(model, view)]
"""
