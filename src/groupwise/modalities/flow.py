"""A 2-D flow-matching generator as a trainer policy, with Flow-GRPO's SDE step and its log-prob.

Flow-GRPO: "Flow-GRPO: Training Flow Matching Models via Online RL", Jie Liu, Gongye Liu, Jiajun
Liang et al., 2025, https://arxiv.org/abs/2505.05470. Flash-GRPO (one SDE step per rollout,
iso-temporal): arXiv 2605.15980, code https://github.com/Shredded-Pork/Flash-GRPO
(``flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob2.py``), spec 14-flash-grpo.md.

**Change vs GRPO**: the "tokens" are denoising steps. A rollout row is one 2-D sample drawn by an
Euler sampler from x ~ N(0, I) at σ = 1 down to σ = 0; the steps run as SDE steps (stochastic,
with a Gaussian log-prob: the policy's actions) are the trained ones, the others are ODE steps.

**Math** (step i: ``σ = sigmas[i]``, ``σ' = sigmas[i+1]``, ``dt = σ' − σ < 0``; D = 2 dims)::

    sigmas  = shift·u / (1 + (shift − 1)·u),   u = linspace(1, 0, steps + 1)
    ODE:      x' = x + v_θ(x, σ, label)·dt
    SDE:      std_t = σ_min + (σ_max − σ_min)·σ          σ_max = sigmas[1], σ_min = sigmas[-1]
              mean  = x(1 + std_t²/(2σ)·dt) + v_θ(1 + std_t²(1−σ)/(2σ))·dt
              x'    = mean + std_t·√(−dt)·ε,   ε ~ N(0, I)
              logp  = mean_d[ −(x'−mean)²/(2 std_t² (−dt)) − log(std_t √(−dt)) − log √(2π) ]
    c(t)    = √(−dt)/std_t + std_t √(−dt)(1−σ)/(2σ) = |∂logp/∂v| · D / |ε|     (coe = 1/c)

**Defaults**

- ``steps = 10`` [INFERRED] the toy's Euler steps (specs/README Toy-Flow-2D: K = 10); Flash-GRPO
  samples Wan with 20 [CODE].
- ``shift = 1.0`` (linear sigmas) [INFERRED] for the toy; Wan uses ``shift = 3`` [CODE] ``config/dgx.py``
  (with it, 20 steps reproduce the authors' 1/c table to 0.15 %, ``tests/test_flash_grpo.py``).
- ``sde = "one_shared"`` [CODE] Flash-GRPO; ``"all"`` is Flow-GRPO (every step SDE and trained);
  ``"one_per_row"`` [INFERRED] is the spec's ablation (b); ``"none"`` (all ODE, T = 0) is for evaluation.
- ``sde_window = steps // 2`` [CODE] the index is uniform over the first 10 of 20 steps.
- ``hidden = 64``, ``layers = 3`` (2→64→64→2 plus σ and label features) [INFERRED] specs/README toy.
- ``condition = "label"`` [INFERRED] the toy's label embedding (Flash-GRPO's form, bit-for-bit as
  before). ``"embedding"`` is E²PO's CPU implementation (spec 15): each label's prompt is one
  ``embed_dim = 8``-d token [PAPER: the spec's toy] read through a frozen random MLP "text
  encoder" (:class:`PromptEncoder`: 8 → ``encoder_hidden = 32`` tanh → ``cond_dim = 16``
  [INFERRED], seeded by ``encoder_seed = 0``); the velocity net reads the condition through a
  linear map initialised N(0, (2/√cond_dim)²) [INFERRED] (a condition of norm ≈ 2.8 then offsets
  each hidden unit about as much as the label table's N(0, 1)).

**Notes**

1. Seeds: row j of a request samples with ``torch.Generator(sample_seed(seed, step, key, offset + j))``
   (x_1, then ε for every step, then the row's index for ``one_per_row``); the shared index of
   ``one_shared`` uses ``sample_seed(seed, step, key, −1 − offset)`` (negative indices never name a
   row). A request's samples do not depend on the rest of the batch.
2. Contract with weights (token extras [B,G,T(,2)] float32, 0 where ``mask`` is False):
   ``flow_x`` (x before the trained step), ``flow_x_next`` (after it), ``flow_sigma`` (σ),
   ``flow_sigma_next`` (σ'), ``flow_std`` (std_t); ``flow_step`` (int64 step index i). Row extra
   ``x_final`` [B,G,2]: the sample at σ = 0. ``logp_sampler`` holds the log-probs of sampling.
3. ``forward`` recomputes logp of the stored x' given the stored x under the current net (the
   spec's one trainable forward per sample at the selected step); ``x'`` is data, never differentiated.
   The net and the step maths run in float64 and the trajectory is stored in float32 after each
   step, so the recomputation sees exactly the sampler's inputs: in float32 the matmuls round
   differently for different batch sizes, which moved a float32 recomputation's logp by 1.2e-6 at
   σ = 0.2 (noise scale std·√(−dt) = 0.057).
4. ``sampling`` (temperature, max_new_tokens, ...) is ignored: the SDE noise is fixed by the schedule.
   ``encode(label) -> [label]`` and ``decode(rollout) -> [B][G] "x,y"`` mirror the LM policy's.
5. Generation hooks (``groupwise.hooks``): the embedding form applies ``embed_delta`` (its
   ``hooks``); the label form applies none, so a strategy that samples under one is refused at
   build. Row j of a hooked request samples with C^opt = f(E + δ_j) mixed into C^orig = f(E) per
   step by E²PO's noise-aware schedule, C(σ) = γ(σ)·C^opt + (1 − γ(σ))·C^orig with
   γ = ``hooks.noise_aware_gamma(σ, rho)`` (γ = 1 when the hook's ``rho`` is None); rows
   with δ = 0 read C^orig exactly (bit-identical to unhooked sampling). ``forward`` always reads
   C^orig: the stored trajectory is scored on the original condition (the reference-anchored
   update). ``prompt_encoder()`` is E²PO phase I's view (``phases/e2po_perturb.prompt_space``).
6. Subclasses condition the velocity on more than the label through two hooks: ``_velocity(x, σ,
   label, cond)`` (``cond`` [N,...] per row, from ``_generate_flow``'s ``cond`` [B,G,...]) and
   ``_stored_condition(rollout, sel)`` (the same condition for the stored steps, at training); the
   ``unified`` policy (``modalities/unified.py``) passes its think tokens this way.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from groupwise.modalities.flow_condition import PromptEncoder, hooked_conditions, mixed_condition
from groupwise.modalities.flow_sde import flow_sigmas, sde_step_with_logprob
from groupwise.seeds import sample_seed
from groupwise.types import Request, Rollout, StepInfo

SDE_MODES = ("all", "one_shared", "one_per_row", "none")
CONDITIONS = ("label", "embedding")
TOKEN_EXTRAS = ("flow_x", "flow_x_next", "flow_sigma", "flow_sigma_next", "flow_std", "flow_step")


class VelocityMLP(nn.Module):
    """v_θ(x [N,2], σ [N], cond [N]) -> [N,2]: an MLP on x and Fourier features of σ, plus a label
    embedding (``cond`` int64 labels) or, with ``cond_dim``, a linear read of a condition vector
    (``cond`` [N,cond_dim] float: the prompt encoder's output, :class:`PromptEncoder`)."""

    def __init__(self, n_labels: int, hidden: int = 64, layers: int = 3, freqs: int = 4, cond_dim: int | None = None):
        super().__init__()
        if n_labels < 1 or hidden < 1 or layers < 2 or (cond_dim is not None and cond_dim < 1):
            raise ValueError(
                "VelocityMLP needs n_labels >= 1, hidden >= 1, layers >= 2, "
                f"cond_dim >= 1; got {n_labels}, {hidden}, {layers}, {cond_dim}"
            )
        self.n_labels = n_labels
        self.register_buffer("freqs", math.pi * torch.arange(1, freqs + 1, dtype=torch.float32))  # [F]
        self.inp = nn.Linear(3 + 2 * freqs, hidden)
        if cond_dim is None:
            self.label = nn.Embedding(n_labels, hidden)
        else:
            self.cond = nn.Linear(cond_dim, hidden, bias=False)
            # a condition of norm ~2.8 offsets each unit by ~1.4, like the label table's N(0, 1)
            nn.init.normal_(self.cond.weight, std=2.0 / math.sqrt(cond_dim))
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers - 2))
        self.out = nn.Linear(hidden, 2)

    def forward(self, x: Tensor, sigma: Tensor, label: Tensor | None, extra: Tensor | None = None) -> Tensor:
        """``label`` None: no label embedding; ``extra`` [N,H]: a further condition embedding added to it."""
        x, sigma = x.to(self.freqs.dtype), sigma.to(self.freqs.dtype)  # the parameters' dtype
        f = sigma[:, None] * self.freqs  # [N,F]
        feats = torch.cat([x, sigma[:, None], torch.sin(f), torch.cos(f)], dim=-1)  # [N,3+2F]
        pre = self.inp(feats)  # [N,H]
        if label is not None:  # the label form's embedding row, or the embedding form's condition projected
            # [N,H]
            pre = pre + (self.label(label) if hasattr(self, "label") else self.cond(label.to(self.freqs.dtype)))
        if extra is not None:
            pre = pre + extra.to(pre.dtype)  # [N,H]
        h = nn.functional.silu(pre)  # [N,H]
        for layer in self.hidden:
            h = nn.functional.silu(layer(h))  # [N,H]
        return self.out(h)  # [N,2]


class FlowPolicy:
    """Euler flow sampler over 2-D points conditioned on a label, SDE steps per ``sde`` (Flow-/Flash-GRPO)."""

    def __init__(
        self,
        n_labels: int = 4,
        hidden: int = 64,
        layers: int = 3,
        steps: int = 10,
        sde: str = "one_shared",
        sde_window: int | None = None,
        shift: float = 1.0,
        init_seed: int = 0,
        condition: str = "label",
        embed_dim: int = 8,
        encoder_hidden: int = 32,
        cond_dim: int = 16,
        encoder_seed: int = 0,
    ):
        if sde not in SDE_MODES:
            raise ValueError(f"FlowPolicy: sde must be one of {', '.join(SDE_MODES)}, got {sde!r}")
        if condition not in CONDITIONS:
            raise ValueError(f"FlowPolicy: condition must be one of {', '.join(CONDITIONS)}, got {condition!r}")
        window = steps // 2 if sde_window is None else sde_window
        if steps < 1 or not 1 <= window <= steps or shift <= 0:
            raise ValueError(
                f"FlowPolicy: need steps >= 1, 1 <= sde_window <= steps, shift > 0; got {steps}, {window}, {shift}"
            )
        self.config = {"n_labels": n_labels, "hidden": hidden, "layers": layers, "steps": steps, "shift": shift}
        if condition == "embedding":  # the label form's config (and so its checkpoints) stays as it was
            self.config.update(
                condition=condition,
                embed_dim=embed_dim,
                encoder_hidden=encoder_hidden,
                cond_dim=cond_dim,
                encoder_seed=encoder_seed,
            )
        self.condition = condition
        self.sde, self.window, self.steps = sde, window, steps
        self.sigmas = flow_sigmas(steps, shift)  # [K+1]
        self.sigma_max, self.sigma_min = float(self.sigmas[1]), float(self.sigmas[-1])
        with torch.random.fork_rng(devices=[]):  # seeded init that leaves the global stream alone
            torch.manual_seed(init_seed)
            self.net = VelocityMLP(
                n_labels, hidden, layers, cond_dim=cond_dim if condition == "embedding" else None
            ).double()  # float64: see Note 3
        self.encoder: PromptEncoder | None = None
        if condition == "embedding":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(encoder_seed)
                self.encoder = PromptEncoder(n_labels, embed_dim, encoder_hidden, cond_dim).double()
        self.trainable = True
        self.modality = "flow"
        self.request_options = frozenset({"greedy"})  # greedy = the deterministic ODE (Request.sampling)
        # groupwise.hooks kinds generate applies
        self.hooks = frozenset({"embed_delta"}) if condition == "embedding" else frozenset()

        self.reference: FlowPolicy | None = None
        self.context = None  # no context length: a label is the whole prompt

    @property
    def T(self) -> int:
        return self._steps_trained(self.sde)

    def _steps_trained(self, sde: str) -> int:
        return {"all": self.steps, "none": 0}.get(sde, 1)

    def check_fits(self, ids: list[int], max_new_tokens: int, where: str) -> None:
        """Nothing to check: the sampler's length is ``steps``, not a token budget."""

    # ------------------------------------------------------------------ sampling
    def encode(self, prompt: Any) -> list[int]:
        """A dataset prompt (a label, or ``[label]``) as the policy's prompt ids ``[label]``."""
        label = prompt[0] if isinstance(prompt, (list, tuple)) and len(prompt) == 1 else prompt
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < self.net.n_labels:
            raise ValueError(f"FlowPolicy: a prompt must be a label in [0, {self.net.n_labels}), got {prompt!r}")
        return [label]

    def decode(self, rollout: Rollout) -> list[list[str]]:
        """[B][G] texts of the final samples, ``"x,y"`` ("" for padding rows), for logs and text rewards."""
        finals, valid = rollout.extras["x_final"].tolist(), rollout.group_valid.tolist()
        return [[f"{x:.4f},{y:.4f}" if ok else "" for (x, y), ok in zip(row, oks)] for row, oks in zip(finals, valid)]

    def _draws(self, requests: Sequence[Request], info: StepInfo, G: int) -> tuple[Tensor, Tensor, Tensor]:
        """x_1 [B,G,2], ε [B,G,K,2] and the SDE step index [B,G] of every row, from its own seed."""
        B, K = len(requests), self.steps
        x1, eps, idx = torch.zeros(B, G, 2), torch.zeros(B, G, K, 2), torch.zeros(B, G, dtype=torch.long)
        for b, req in enumerate(requests):
            offset = getattr(req, "offset", 0)
            shared = torch.Generator().manual_seed(sample_seed(info.seed, info.step, req.key, -1 - offset))
            group_idx = torch.randint(self.window, (1,), generator=shared)
            for j in range(req.n):
                g = torch.Generator().manual_seed(sample_seed(info.seed, info.step, req.key, offset + j))
                x1[b, j], eps[b, j] = torch.randn(2, generator=g), torch.randn(K, 2, generator=g)
                idx[b, j] = torch.randint(self.window, (1,), generator=g) if self.sde == "one_per_row" else group_idx
        return x1, eps, idx

    def original_condition(self, labels: Tensor) -> Tensor:
        """[N,cond_dim] float64: the embedding form's condition C^orig = f(tokens[label]) of each label [N]."""
        if self.encoder is None:
            raise ValueError(
                "FlowPolicy.original_condition: the label form has no "
                'condition vector (model.params.condition = "embedding")'
            )
        return self.encoder(self.encoder.tokens[labels])  # [N,c]

    def prompt_encoder(self) -> tuple[Tensor, Any]:
        """E²PO phase I's view of the embedding condition (``phases/e2po_perturb.prompt_space``):
        ``(tokens [n_labels,d], f)`` with ``f(emb [M,S,d], real [M,S]) -> [M,cond_dim]`` the frozen
        encoder of the sum of the real tokens' embeddings (a flow prompt is one token: S = 1)."""
        if self.encoder is None:
            raise ValueError(
                "the flow policy's label form has no prompt embedding "
                'to perturb; set model.params.condition = "embedding"'
            )
        encoder = self.encoder

        def encode(emb: Tensor, real: Tensor) -> Tensor:
            return encoder((emb.to(encoder.w1.dtype) * real[..., None]).sum(1))  # [M,c]

        return encoder.tokens, encode

    def _conditions(self, requests: Sequence[Request], labels: Tensor, G: int) -> tuple[Tensor | None, ...]:
        """The embedding form's per-row conditions of a call (``flow_condition.hooked_conditions``;
        None ×4 for the label form)."""
        if any(r.hook is not None for r in requests) and self.encoder is None:
            raise ValueError(
                "FlowPolicy.generate: a generation hook needs the embedding "
                'condition (model.params.condition = "embedding"); '
                "the label form applies no hooks"
            )
        return (
            (None, None, None, None) if self.encoder is None else hooked_conditions(self.encoder, requests, labels, G)
        )

    def _velocity(self, x: Tensor, sigma: Tensor, label: Tensor, cond: Tensor | None) -> Tensor:
        """v_θ [N,2] of points x [N,2] at σ [N] for labels [N] (the embedding form: conditions [N,c]);
        ``cond`` [N,...] a subclass's further condition (None here)."""
        return self.net(x, sigma, label)  # [N,2]

    def _stored_condition(self, rollout: Rollout, sel: Tensor) -> Tensor | None:
        """The further condition of the selected trained steps ``sel`` [B,G,T] (None: the label is all)."""
        return None

    @torch.no_grad()
    def generate(self, requests: Sequence[Request], sampling: dict, info: StepInfo) -> Rollout:
        return self._generate_flow(requests, sampling, info, None)

    def _generate_flow(
        self, requests: Sequence[Request], sampling: dict, info: StepInfo, cond: Tensor | None
    ) -> Rollout:
        """The rows of ``requests`` (``cond`` [B,G,...]: a further per-row condition for ``_velocity``, or None)."""
        if not requests or any(r.n < 1 for r in requests):
            raise ValueError("FlowPolicy.generate needs at least one request, each with n >= 1")
        labels = torch.tensor([self.encode(r.prompt)[0] for r in requests])  # [B]
        sde = "none" if sampling.get("greedy") else self.sde  # evaluation: the deterministic ODE
        B, G, K, T = len(requests), max(r.n for r in requests), self.steps, self._steps_trained(sde)
        valid = torch.arange(G)[None, :] < torch.tensor([r.n for r in requests])[:, None]  # [B,G]
        x1, eps, idx = self._draws(requests, info, G)  # [B,G,2], [B,G,K,2], [B,G]
        N = B * G
        x, lab, idx, eps = x1.view(N, 2), labels.repeat_interleave(G), idx.view(N), eps.view(N, K, 2)
        c_orig, c_pert, perturbed, rho = self._conditions(requests, labels, G)  # [N,c] / [N] (None: label form)
        rec = {k: torch.zeros(N, T, 2) for k in ("flow_x", "flow_x_next")}
        rec.update({k: torch.zeros(N, T) for k in ("flow_sigma", "flow_sigma_next", "flow_std", "logp")})
        rec["flow_step"] = torch.zeros(N, T, dtype=torch.long)
        for i in range(K):
            s, sp = self.sigmas[i].expand(N), self.sigmas[i + 1].expand(N)  # [N], [N]
            # [N] labels or [N,c]
            c = lab if c_orig is None else mixed_condition(c_orig, c_pert, perturbed, rho, float(self.sigmas[i]))
            v = self._velocity(x, s, c, None if cond is None else cond.reshape(N, *cond.shape[2:]))  # [N,2]
            sde_rows = torch.full((N,), sde == "all") if sde in ("all", "none") else idx == i  # [N]
            x_next = (x.double() + v * (sp - s).double()[:, None]).float()  # [N,2] ODE step
            if sde_rows.any():
                x_sde, logp, _, std, _, _ = sde_step_with_logprob(
                    v, x, s, sp, self.sigma_min, self.sigma_max, noise=eps[:, i]
                )
                x_next = torch.where(sde_rows[:, None], x_sde, x_next)  # [N,2]
                t = i if sde == "all" else 0
                r = sde_rows.nonzero()[:, 0]  # rows whose trained step is i
                for key, value in (
                    ("flow_x", x),
                    ("flow_x_next", x_next),
                    ("flow_sigma", s),
                    ("flow_sigma_next", sp),
                    ("flow_std", std),
                    ("logp", logp),
                ):
                    rec[key][r, t] = value[r]
                rec["flow_step"][r, t] = i
            x = x_next
        mask = valid[..., None].expand(B, G, T).clone()  # [B,G,T] every trained step of a real row
        finals = x.view(B, G, 2)  # [B,G,2]
        out = Rollout(
            prompt_ids=[[int(label)] for label in labels],
            actions=torch.zeros(B, G, T, dtype=torch.long),  # [B,G,T] continuous actions live in the extras
            mask=mask,
            group_valid=valid,
            truncated=torch.zeros(B, G, dtype=torch.bool),
            prompt_index=torch.tensor([r.key for r in requests], dtype=torch.long),
            meta=[{"prompt": int(label)} for label in labels],
            logp_sampler=rec.pop("logp").view(B, G, T) * mask,  # [B,G,T]
        )
        for key, value in rec.items():
            value = value.view(B, G, T, *value.shape[2:])  # [B,G,T(,2)]
            out.set_extra(key, value * mask.view(B, G, T, *[1] * (value.dim() - 3)), "token")
        out.set_extra("x_final", torch.where(valid[..., None], finals, torch.zeros(())), "row")  # [B,G,2]
        out.completions = self.decode(out)
        return out

    # ------------------------------------------------------------------ scoring and training
    def forward(self, rollout: Rollout, quantities: Sequence[str] = ("logp",)) -> dict[str, Tensor]:
        """``{"logp": [B,G,T] float32}``: log-prob of each stored SDE transition under the current net;
        ``"entropy"`` on request: the Gaussian step's entropy per dimension, ½·log(2πe) + log(std_t·√−dt)
        (fixed by the schedule, logged like an LM's token entropy)."""
        unknown = [q for q in quantities if q not in ("logp", "entropy")]
        if unknown:
            raise ValueError(f"FlowPolicy.forward computes 'logp' and 'entropy', not {unknown}")
        missing = [k for k in TOKEN_EXTRAS if k not in rollout.extras]
        if missing:
            raise ValueError(f"FlowPolicy.forward needs the token extras {missing}, written by FlowPolicy.generate")
        sel = rollout.mask.bool()  # [B,G,T]
        labels = torch.tensor([p[0] for p in rollout.prompt_ids], dtype=torch.long)  # [B]
        lab = labels[:, None, None].expand(sel.shape)[sel]  # [M]
        x, x_next = rollout.extras["flow_x"][sel], rollout.extras["flow_x_next"][sel]  # [M,2], [M,2]
        s, sp = rollout.extras["flow_sigma"][sel], rollout.extras["flow_sigma_next"][sel]  # [M], [M]
        logp = torch.zeros(sel.shape)  # [B,G,T]
        if sel.any():
            # [M] labels or [M,c] C^orig: never a hook's condition
            cond = lab if self.encoder is None else self.original_condition(lab)
            v = self._velocity(x, s, cond, self._stored_condition(rollout, sel))  # [M,2]
            logp[sel] = sde_step_with_logprob(v, x, s, sp, self.sigma_min, self.sigma_max, prev_sample=x_next)[1]  # [M]
        out = {"logp": logp}
        if "entropy" in quantities:
            scale = (
                rollout.extras["flow_std"]
                * (rollout.extras["flow_sigma"] - rollout.extras["flow_sigma_next"]).clamp(min=0).sqrt()
            )  # [B,G,T]
            out["entropy"] = torch.where(
                sel, 0.5 * math.log(2 * math.pi * math.e) + scale.clamp(min=1e-30).log(), torch.zeros(())
            )  # [B,G,T]
        return out

    def scoring_models(self, with_reference: bool) -> dict[str, Any]:
        """The policies needs are read from, by role: this one and (built on request) a frozen snapshot."""
        if with_reference and self.reference is None:
            self.reference = self.snapshot()
        models = {"policy": lambda: contextlib.nullcontext(self)}
        if self.reference is not None:
            models["ref"] = lambda: contextlib.nullcontext(self.reference)
        return models

    def score(self, handle: FlowPolicy, rollout: Rollout, quantities: Sequence[str]) -> dict[str, Tensor]:
        return handle.forward(rollout, quantities)

    def save(self, folder: Any) -> None:
        """``flow_policy.pt`` (config + weights) in ``folder``: ``FlowPolicy(**config)`` then ``load_state_dict``."""
        from pathlib import Path

        Path(folder).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(folder) / "flow_policy.pt")

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def snapshot(self) -> FlowPolicy:
        reference, self.reference = self.reference, None  # a snapshot holds no snapshot of its own
        twin = copy.deepcopy(self)
        self.reference = reference
        for p in twin.net.parameters():
            p.requires_grad_(False)
        twin.trainable = False
        twin.net.eval()
        return twin

    def state_dict(self) -> dict:
        state = {"config": dict(self.config), "net": {k: v.clone() for k, v in self.net.state_dict().items()}}
        if self.reference is not None:
            state["reference"] = {k: v.clone() for k, v in self.reference.net.state_dict().items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != self.config:
            raise ValueError(
                "FlowPolicy.load_state_dict: the state was saved from "
                f"{state.get('config')}, this policy is {self.config}"
            )
        self.net.load_state_dict(state["net"])
        if self.reference is not None and "reference" in state:
            self.reference.net.load_state_dict(state["reference"])

    def train(self) -> None:
        self.net.train()

    def eval(self) -> None:
        self.net.eval()
